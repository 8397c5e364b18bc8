"""The CUDA side of an FP8 checkpoint: once the loader has filled the language model from the dequantized
checkpoint (quantization.py), the layers whose checkpoint weights were FP8 get FP8 parameters back, and their
forward goes through kernels/fp8_gemm.py.

* Tensor-parallel linears (q/k/v, o, gate/up, down, Qwen3.5's linear-attention projections, shared experts): the
  rank's shard re-quantized with the checkpoint's own granularity: 128 x 128 blocks for block FP8, one scale per
  row for channel FP8. Where the shard's tiles coincide with the checkpoint's (offsets multiples of 128; always
  true at TP 1) this gives back the checkpoint's FP8 values exactly: each value was dequantized with one float32
  rounding, so dividing by the recomputed scale (within 2^-9 of the stored one) lands well inside the same e4m3
  rounding interval.
* Stacked routed experts (Qwen3-VL-MoE, Qwen3.5-MoE): one scale per expert row, for ``torch._scaled_grouped_mm``'s
  row-wise recipe; a block checkpoint's experts are therefore re-quantized more coarsely than stored. Experts that
  only run as a loop (Gemma 4) stay in the model dtype.
* Replicated ``nn.Linear`` layers (routers, Gemma 4's per-layer-input projections) and the vision tower stay in the
  model dtype: they were dequantized at load, and stay so.
The load itself holds the language model in the model dtype until this pass runs (peak memory as a bf16 model).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from workers.engine.kernels import fp8_gemm
from workers.engine.kernels.fp8_quant import quantize_block, quantize_rows
from workers.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.engine.models.qwen3_vl.moe import StackedExperts

log = logging.getLogger("glimpse.fp8")


def fp8_parameters(lm: nn.Module, checkpoint_names: Iterable[str]) -> set[str]:
    """The LM parameter names the given canonical checkpoint names (``lm.*``, FP8 on disk) were loaded into."""
    route = getattr(lm, "route", None)
    params = set()
    for name in checkpoint_names:
        if name.startswith("lm."):
            local = name[len("lm.") :]
            params.add(route(local)[0] if route is not None else local)
    return params


@torch.no_grad()
def convert_to_fp8(lm: nn.Module, params: set[str], block: int | None) -> int:
    """Give the modules owning ``params`` FP8 weights (see the module docstring); returns how many were converted."""
    converted = 0
    for name in sorted(params):
        owner_name, _, attr = name.rpartition(".")
        owner = lm.get_submodule(owner_name)
        if isinstance(owner, ColumnParallelLinear | RowParallelLinear) and attr == "weight":
            q, scale = quantize_block(owner.weight) if block else quantize_rows(owner.weight)
            owner.weight = nn.Parameter(q, requires_grad=False)
            owner.weight_scale = scale
            converted += 1
        elif isinstance(owner, StackedExperts) and owner.fp8_grouped and attr == "gate_up_proj":
            if not fp8_gemm.grouped_usable(owner.down_proj[0, :1], owner.down_proj):
                continue
            # Both stacks at once: the grouped path needs the two in FP8 (down's name is in ``params`` too).
            q_gu, s_gu = quantize_rows(owner.gate_up_proj)
            q_d, s_d = quantize_rows(owner.down_proj)
            owner.gate_up_proj = nn.Parameter(q_gu, requires_grad=False)
            owner.down_proj = nn.Parameter(q_d, requires_grad=False)
            owner.gate_up_scale, owner.down_scale = s_gu, s_d
            converted += 1
    return converted


def convert_loaded(lm: nn.Module, checkpoint_names: Iterable[str], block: int | None, rank: int = 0) -> int:
    """After the load: FP8 layers for the checkpoint's FP8 weights where the device runs FP8 GEMMs (else none)."""
    device = next(lm.parameters()).device
    if not fp8_gemm.wants_fp8_layers(device):
        return 0
    n = convert_to_fp8(lm, fp8_parameters(lm, checkpoint_names), block)
    if rank == 0:
        log.info("FP8: %d language-model layers hold FP8 weights (%s scales, GEMM variant %s)",
                 n, "128x128 block" if block else "per-channel", fp8_gemm.variant())
    return n
