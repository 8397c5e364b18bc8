"""What cuBLAS's first use of a GEMM kernel costs in a fresh process, and how much of it a warm-up ladder takes away.

Part 1: host time of ``F.linear`` at a row count M for the first, second and third time, for the LM's and ViT's
weight shapes (Qwen2.5-VL-7B), in the order given: a first call whose kernel the process has not used yet costs
milliseconds, the next row count on the same kernel a fraction of one. Part 2: after the start-up warm-up's chunk
ladder (``warmup._CHUNK_STEP``) or the old one of 7 shares, how many of 100 random row counts in [256, 4096] still
meet a kernel not used yet in one of the LM's four GEMMs. Each part runs in a fresh process. CUDA only.

    python -m benchmarks.kernels.cublas_first_use
    CUDA_MODULE_LOADING=EAGER python -m benchmarks.kernels.cublas_first_use --part 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

# (N, K, bias, row counts): the ViT's qkv, the LM's qkv and down projections, the ViT's down projection (padded)
SHAPES = [
    (3840, 1280, True, [10000, 10764, 10765, 21528, 21529, 32292, 2691, 5382]),
    (4608, 3584, True, [4096, 1351, 1352, 1111, 2222, 3333, 4095]),
    (3584, 18944, False, [4096, 1351, 1352, 1111, 2222]),
    (1280, 3424, True, [10764, 10765, 21528, 7777]),
]
LM = [(4608, 3584, True), (3584, 3584, False), (37888, 3584, False), (3584, 18944, False)]
SLOW_S = 2e-3  # host time that means a kernel's first use (repeats take 0.03-0.15 ms, a new row count 0.3-0.45)


def _linear_ms(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    t0 = time.perf_counter()
    F.linear(x, w, b)
    ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return ms


def part1() -> list[list[object]]:
    rows: list[list[object]] = []
    _linear_ms(*(torch.randn(64, 64, device="cuda", dtype=torch.bfloat16),) * 2, None)  # cuBLAS's handle, once
    for n, k, bias, ms in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        x = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            rows.append([f"{n}x{k}", m, *(round(_linear_ms(x[:m], w, b), 2) for _ in range(3))])
    return rows


def ladder(kind: str, longest: int = 4096) -> list[int]:
    """The chunk lengths of the start-up warm-up (new), or of its earlier 7 shares (old, `_LADDER`)."""
    from workers.engine.runner.warmup import _LADDER, chunk_ladder

    if kind == "old":
        return sorted({max(1, int(longest * s)) for s in _LADDER}, reverse=True)
    return chunk_ladder(longest)


def part2(kind: str) -> list[object]:
    xs = {k: torch.randn(4096, k, device="cuda", dtype=torch.bfloat16) for k in (3584, 18944)}
    ws = [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16),
           torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None) for n, k, bias in LM]
    sizes = ladder(kind)
    for m in sizes:
        for w, b in ws:
            F.linear(xs[w.shape[1]][:m], w, b)
    torch.cuda.synchronize()
    rng, rows_hit, calls_hit = random.Random(1), 0, 0
    for _ in range(100):
        m = rng.randint(256, 4096)
        slow = sum(_linear_ms(xs[w.shape[1]][:m], w, b) > SLOW_S * 1e3 for w, b in ws)
        rows_hit, calls_hit = rows_hit + (slow > 0), calls_hit + slow
    return [kind, len(sizes), rows_hit, calls_hit]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["1", "2", "all"], default="all")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cublas_first_use: needs a CUDA GPU")
    if args.child:  # one measurement in a fresh process: its output is one JSON line
        print(json.dumps(part1() if args.child == "1" else part2(args.child)))
        return

    def child(what: str) -> object:
        out = subprocess.run([sys.executable, "-m", "benchmarks.kernels.cublas_first_use", "--child", what],
                             check=True, capture_output=True, text=True, env=os.environ).stdout
        return json.loads(out.strip().splitlines()[-1])

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(default)')}")
    if args.part in ("1", "all"):
        print("\n| N x K | M | first ms | second ms | third ms |\n|---|---|---|---|---|")
        for row in child("1"):  # type: ignore[attr-defined]
            print("| " + " | ".join(str(v) for v in row) + " |")
    if args.part in ("2", "all"):
        print("\n| chunk ladder | sizes | random M (of 100) meeting a new kernel | GEMM calls (of 400) |\n|---|---|---|---|")
        for kind in ("old", "new"):
            print("| " + " | ".join(str(v) for v in child(kind)) + " |")  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
