"""How fast Triton compiles an autotune's candidates: one after another, on threads, and in processes. No GPU is
needed: every candidate is compiled for a named target (default Hopper, sm_90) down to its cubin, each way into an
empty cache directory of its own.

    python -m benchmarks.kernels.compile_bench [--workers 16] [--candidates 24] [--arch 90]

The candidates are a bf16 GEMM tile kernel's (block sizes, warps and stages, as an autotune lists them, like
flash-linear-attention's chunk kernels that a hybrid model's warm-up tunes on a new host). Threads are what
``kernels/autotune_compiles.py`` uses; if they gain little over one after another while processes gain, the
Python side of Triton's compile (holding the GIL) bounds them, and compiling in processes is what would cut a cold
start's autotunes. The processes' column counts their start (a spawned interpreter importing Triton) apart. On the
2-core dev box (24 candidates, Triton 3.8.0): 8.63 s one after another, 4.51 s on 2 threads, 4.41 s in 2
processes.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.args import parser


@triton.jit
def gemm_tile(a_ptr, b_ptr, c_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * k + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k), other=0.0)
        b = tl.load(b_ptr + ks[:, None] * n + cols[None, :], mask=(ks[:, None] < k) & (cols[None, :] < n), other=0.0)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rows[:, None] * n + cols[None, :], acc.to(tl.bfloat16), mask=(rows[:, None] < m) & (cols[None, :] < n))


SIGNATURE = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "m": "i32", "n": "i32", "k": "i32",
             "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}  # fmt: skip
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
Candidate = tuple[int, int, int, int, int]


def candidates(count: int) -> list[Candidate]:
    grid = itertools.product((64, 128), (64, 128), (32, 64), (4, 8), (2, 3, 4))
    return list(grid)[:count]


def compile_one(candidate: Candidate, arch: int, cache: str) -> int:
    """One candidate to its cubin, cached under ``cache`` (Triton reads the variable at each compile); its size."""
    os.environ["TRITON_CACHE_DIR"] = cache
    bm, bn, bk, warps, stages = candidate
    src = ASTSource(gemm_tile, SIGNATURE, {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk})
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    return len(kernel.asm["cubin"])


def timed(name: str, run: Callable[[str], list[int]]) -> tuple[str, float, int]:
    """``run`` with an empty cache directory of its own: (name, seconds, candidates compiled)."""
    with tempfile.TemporaryDirectory() as cache:
        started = time.perf_counter()
        sizes = run(cache)
        return name, time.perf_counter() - started, len(sizes)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--candidates", type=int, default=24)
    ap.add_argument("--arch", type=int, default=90, help="the CUDA compute capability compiled for (90: Hopper)")
    args = ap.parse_args()
    todo = candidates(args.candidates)
    n = len(todo)

    def on(pool: Executor, cache: str) -> list[int]:
        return list(pool.map(compile_one, todo, [args.arch] * n, [cache] * n))

    # Triton's own first-use costs (its key, the backend) out of every column: a compile in this process, and one
    # in each process before its column's clock starts
    timed("first use", lambda cache: [compile_one(todo[0], args.arch, cache)])
    rows = [timed("one after another", lambda cache: [compile_one(c, args.arch, cache) for c in todo])]
    with ThreadPoolExecutor(args.workers) as threads:
        rows.append(timed(f"{args.workers} threads", lambda cache: on(threads, cache)))
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as processes:
        start_s = timed("start", lambda cache: list(processes.map(
            compile_one, todo[:1] * args.workers, [args.arch] * args.workers, [cache] * args.workers)))[1]  # fmt: skip
        rows.append(timed(f"{args.workers} processes (their start: {start_s:.1f} s more)", lambda cache: on(processes, cache)))
    serial = rows[0][1]
    print(f"\n{len(todo)} candidates of a bf16 GEMM tile for sm_{args.arch}, Triton {triton.__version__}, "
          f"{os.cpu_count()} cores\n")  # fmt: skip
    print("| how | seconds | candidates a second | against one after another |\n|---|---|---|---|")
    for name, seconds, count in rows:
        print(f"| {name} | {seconds:.2f} | {count / seconds:.1f} | {serial / seconds:.2f}x |")


if __name__ == "__main__":
    main()
