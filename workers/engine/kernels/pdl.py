"""Programmatic dependent launch (Hopper and later) for the decode step's hand-written Triton kernels.

A batch-1 decode step is ~400 short kernels in a row (Qwen3-VL-8B: 145 weight-streaming GEMMs of 4-40 us and the
norms, rotary, attention and SiLU between them, 1-4 us each). Each one normally starts only once the one before
has drained and flushed: its programs are scheduled and set up while the card idles. Launched with the
programmatic-serialization attribute, a kernel's programs may start as soon as every program of the one before has
signalled (``gdc_launch_dependents``) or exited, and they wait (``gdc_wait``) for it to finish, its writes
visible, before they read its output or write anything.

The small kernels signal first thing, so the GEMM after one is resident and waiting while it runs. The GEMMs
only wait: signalling early let the next kernels' programs sit beside a GEMM's, and a chain of Qwen3-VL-8B's split
down projections and their sums took 1.25 ms against 0.98 launched plainly; launched once the GEMM's last program
has exited, the next kernel still skips its drain and flush (0.94 ms; H200,
`python -m benchmarks.kernels.skinny_gemm_bench --size qwen3-8b --rows 1` under GLIMPSE_PDL=0 and 1).

The rule every kernel launched this way keeps: nothing read or written before ``gdc_wait``. A kernel after one
that neither signals nor exits early (a torch op, cuBLAS, NCCL) starts when that one ends, as without the
attribute, which CUDA graphs capture as a programmatic edge.

``GLIMPSE_PDL=0`` launches everything plainly; the instructions are no-ops in a kernel launched without it.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "GLIMPSE_PDL"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def _triton_has_gdc() -> bool:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: a CUDA card of compute capability 9 or later, a Triton with
    grid dependency control, and GLIMPSE_PDL not "0" (read on every launch, so benchmarks can switch it)."""
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0":
        return False
    return _triton_has_gdc() and _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch(device: torch.device) -> dict[str, bool]:
    """The kernel arguments for a launch on ``device``: the PDL constexpr, and Triton's launch attribute where it
    is on (left out otherwise, so the CPU interpreter never sees it)."""
    on = enabled(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
