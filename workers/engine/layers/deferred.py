"""Language-model weights allocated when their first checkpoint tensor arrives, not when the model is built.

An FP8 checkpoint served on a GPU with FP8 GEMMs is read dequantized (models/quantization.py) and its layers are made
FP8 again (models/fp8_layers.py). Built the usual way, the whole language model first exists in the model dtype:
twice the FP8 weights' bytes (Qwen3.6-35B-A3B: ~65 GiB before conversion, against ~35 GiB once FP8), which is what
kept FP8 checkpoints that fit a GPU only in FP8 from loading at all. Built inside ``deferred_weights()``, the
tensor-parallel linears' weights and the routed experts' stacks are meta tensors (shape and dtype, no memory); the
loader (models/fp8_streaming.py) gives each one memory just before its first tensor is copied in and turns it FP8 as
soon as its last one is, so the model dtype holds only the parameters being filled at a time.

Parameters are replaced on their module (a meta tensor cannot become a real one in place), so whatever fills them
looks them up by name at each tensor, never from a dictionary taken before the load.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

_deferring = False


@contextmanager
def deferred_weights(on: bool = True) -> Iterator[None]:
    """While active (and ``on``), ``weight_empty`` allocates nothing: the weights built are meta tensors."""
    global _deferring
    previous, _deferring = _deferring, on
    try:
        yield
    finally:
        _deferring = previous


def weight_empty(*shape: int) -> Tensor:
    """An uninitialised weight of the default dtype on the default device, or a meta tensor under ``deferred_weights``."""
    return torch.empty(shape, device="meta") if _deferring else torch.empty(shape)


def materialize(module: nn.Module, name: str, device: torch.device) -> Tensor | None:
    """Give ``module``'s meta parameter ``name`` memory on ``device`` (uninitialised, its dtype and shape, its
    attributes such as ``weight_loader`` kept); returns the new parameter, None if it was not a meta tensor."""
    old = module._parameters.get(name)
    if old is None or not old.is_meta:
        return None
    new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=device), requires_grad=False)
    new.__dict__.update(old.__dict__)  # the weight loader rides on the tensor (layers/linear.py)
    module._parameters[name] = new
    return new
