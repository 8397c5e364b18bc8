"""What the first cuDNN SDPA call of a process costs, against a first call at a new length and a steady call.

The vision tower's full-attention blocks move to cuDNN's fused SDPA once a frame length is hot
(workers/engine/layers/vision_attention.py). The first such call in a server stalled a step by 0.6-1 s under load; this
separates the one-off library start from the per-length execution plan, which decides whether a start-up warm-up
at a small shape removes the stall.

    python -m benchmarks.kernels.cudnn_plan_bench          # CUDA only; run it in a fresh process (it measures firsts)
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(length: int, heads: int = 16, dim: int = 80) -> float:
    q, k, v = (torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.synchronize()
    start = time.perf_counter()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    rows = [
        ("first call of the process, 64 tokens", timed(64)),
        ("again, 64 tokens", timed(64)),
        ("first call at 10,764 tokens (one 1080p frame)", timed(10_764)),
        ("again, 10,764 tokens", timed(10_764)),
        ("first call at 5,000 tokens", timed(5_000)),
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print("| call | ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
