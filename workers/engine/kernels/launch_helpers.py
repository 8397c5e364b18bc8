"""What launching the hand-written kernels needs in more than one place: a power-of-two block over a size (Triton's
``tl.arange`` spans a power of two, masked down to the size), and the per-thread state a helper thread sets before it
launches anything (the start-up probes, the skinny GEMM's first launches, the tower's warm-up calls)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for 0 or 1)."""
    return 1 << max(0, n - 1).bit_length()


@contextlib.contextmanager
def worker_thread(device: torch.device) -> Iterator[None]:
    """What a helper thread of the model worker sets first: a thread starts on CUDA's device 0 and outside inference
    mode, and both are per thread."""
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device, torch.inference_mode():
        yield
