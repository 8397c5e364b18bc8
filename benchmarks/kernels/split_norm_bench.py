"""The residual add and RMSNorm after a split-K decode projection: the partials summed by a kernel of their own
and then the compiled add + norm (``apart``, GLIMPSE_SPLIT_NORM=0) against split_norm.py's one kernel, per launch
of warps.

    python -m benchmarks.kernels.split_norm_bench
    python -m benchmarks.kernels.split_norm_bench --rows   # plain rows: the compiled add + norm against the kernel

Each variant runs as a chain of 36 calls on distinct buffers (a decode step's layers), replayed from a CUDA graph,
so a row is the GPU time per call with the launch gaps a decode graph has. bf16 on the GPU. Shapes: the o and down
projections of Qwen3-VL-8B (4,096 wide; 4 splits in bf16, 8 in block FP8) and Qwen2.5-VL-7B (3,584; 4 splits) at
decode batches.

``--rows``: the residual add and norm of plain rows (a prefill step's, a decode graph's), ``RMSNorm.add`` compiled
against ``split_norm.add_rms_norm_rows``: the GPU time per call as above, and the host's time per eager call (the
same chain issued from Python, no sync inside; at one row the GPU keeps up, so that is the launch path's cost).
"""

from __future__ import annotations

import time
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


ROWS_CASES = ((1, 4096), (64, 4096), (512, 4096), (4096, 4096), (4096, 3584))


def rows_chain(rows: int, n: int, warps: int | None) -> Callable[[], None]:
    """``CHAIN`` residual adds and norms of plain rows (``warps`` None: the compiled one)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    calls = [(torch.randn(rows, n, device=dev, dtype=dt), torch.randn(rows, n, device=dev, dtype=dt)) for _ in range(CHAIN)]
    w = torch.ones(n, device=dev, dtype=dt)
    add_norm = fused.compiled(fused.add_rms_norm)

    def run() -> None:
        for x, delta in calls:
            if warps is None:
                add_norm(x, delta, w, 1e-6)
            else:
                split_norm.add_rms_norm_rows(x, delta, w, 1e-6, warps=warps)

    return run


def host_us(run: Callable[[], None], repeats: int = 5) -> float:
    """Host time per call of an eager chain, best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    torch.cuda.synchronize()
    return best * 1e6 / CHAIN


def rows_table() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per call: GPU ({CHAIN} calls graph-replayed) "
          "/ host (eager)")
    print("| rows x width | compiled | " + " | ".join(f"kernel, {w} warps" for w in WARPS) + " |")
    print("|---|---|" + "---|" * len(WARPS))
    for rows, n in ROWS_CASES:
        cells = []
        for warps in (None, *WARPS):
            run = rows_chain(rows, n, warps)
            run()  # compile outside the capture
            torch.cuda.synchronize()
            cells.append(f"{graph_ms(run) * 1e3 / CHAIN:.2f} / {host_us(run):.1f}")
        print(f"| {rows} x {n} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", action="store_true", help="plain rows: the compiled add + norm against the kernel")
    if ap.parse_args().rows:
        rows_table()
        return
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
