"""The residual add and RMSNorm after a split-K decode projection: the partials summed by a kernel of their own
and then the compiled add + norm (``apart``, GLIMPSE_SPLIT_NORM=0) against split_norm.py's one kernel, per launch
of warps.

    python -m benchmarks.kernels.split_norm_bench

Each variant runs as a chain of 36 calls on distinct buffers (a decode step's layers), replayed from a CUDA graph,
so a row is the GPU time per call with the launch gaps a decode graph has. bf16 on the GPU. Shapes: the o and down
projections of Qwen3-VL-8B (4,096 wide; 4 splits in bf16, 8 in block FP8) and Qwen2.5-VL-7B (3,584; 4 splits) at
decode batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.args import parser
from benchmarks.kernels.skinny_gemm_bench import graph_ms
from workers.engine.kernels import fused, split_norm
from workers.engine.kernels.skinny_gemm import Partials

CASES = ((1, 4096, 4), (1, 4096, 8), (1, 3584, 4), (4, 4096, 4), (16, 4096, 8))
CHAIN = 36
WARPS = (4, 8, 16, 32)


def chain(rows: int, n: int, split: int, warps: int | None) -> Callable[[], None]:
    """``CHAIN`` calls of one variant (``warps`` None: apart) over distinct partials and residuals."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    calls = [
        (torch.randn(rows, n, device=dev, dtype=dt), torch.randn(split, rows, n, device=dev), torch.ones(n, device=dev, dtype=dt))
        for _ in range(CHAIN)
    ]
    add_norm = fused.compiled(fused.add_rms_norm)

    def run() -> None:
        for x, parts, w in calls:
            if warps is None:
                add_norm(x, Partials(parts, None, dt).settle(), w, 1e-6)
            else:
                split_norm.add_rms_norm(x, Partials(parts, None, dt), w, 1e-6, warps=warps)

    return run


def main() -> None:
    parser(__doc__).parse_args()  # no flags: --help prints the docstring
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per call, {CHAIN} calls graph-replayed")
    print("| rows x width, splits | apart (sum + compiled norm) | " + " | ".join(f"one kernel, {w} warps" for w in WARPS) + " |")
    print("|---|---|" + "---|" * len(WARPS))
    for rows, n, split in CASES:
        us = []
        for warps in (None, *WARPS):
            run = chain(rows, n, split, warps)
            run()  # compile outside the capture
            torch.cuda.synchronize()
            us.append(graph_ms(run) * 1e3 / CHAIN)
        print(f"| {rows} x {n}, {split} | " + " | ".join(f"{u:.2f}" for u in us) + " |")


if __name__ == "__main__":
    main()
