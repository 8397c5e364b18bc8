"""The ViT's rotary and Qwen3-VL's position embedding: the compiled sites (fused.vit_rope, _qwen3_vit_pos_embed)
against the Triton kernels that replace them (vit_kernels.py), and each one's first call in this process.

    python -m benchmarks.kernels.vit_kernels_bench

Shapes: one 1080p image (8,160 patches at 16 px, Qwen3-VL; 10,764 at 14 px, Qwen2.5-VL) and an 8 x 1080p request,
bf16 on the GPU. "first call" is the site's first use here: for the compiled sites Dynamo's tracing and Inductor's
compile or cache load (the first also imports Inductor), for the kernels Triton's compile or cache load. Prints ms
per call, the bandwidth over the bytes the pass must move and the largest difference from the compiled site.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.args import parser
from benchmarks.engine.vit_bench import cuda_ms
from workers.engine.kernels import fused, vit_kernels
from workers.engine.models.qwen3_vl.vision import _qwen3_vit_pos_embed

# (name, patches, heads, head_dim, hidden)
SHAPES = (("Qwen3-VL 1080p", 8160, 16, 72, 1152), ("Qwen2.5-VL 1080p", 10764, 16, 80, 1280),
          ("Qwen3-VL 8 x 1080p", 65280, 16, 72, 1152))


def first_call_s(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    parser(__doc__).parse_args()  # no flags: --help prints the docstring
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| pass | shape | compiled ms | Triton ms | Triton GB/s | compiled GB/s | first call compiled / Triton, s "
          "| max diff |")
    print("|---|---|---|---|---|---|---|---|")
    rope, pos = fused.compiled(fused.vit_rope), fused.compiled(_qwen3_vit_pos_embed)
    for name, n, h, d, width in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        qkv = torch.randn(n, 3 * h * d, device="cuda", generator=gen, dtype=torch.bfloat16).view(n, 3, h, d)
        angles = torch.rand(n, d // 2, device="cuda", generator=gen) * 100
        cos, sin = angles.cos(), angles.sin()
        table = torch.randn(2304, width, device="cuda", generator=gen, dtype=torch.bfloat16)
        taps = torch.randint(0, 2304, (n, 4), device="cuda", generator=gen)
        weights = torch.rand(n, 4, device="cuda", generator=gen)
        cases = (
            ("rotary", partial(rope, qkv, cos, sin), partial(vit_kernels.vit_rope, qkv, cos, sin),
             n * h * d * 2 * 2 * 2 + n * d * 4),  # read and write q and k, read cos and sin
            ("position embedding", partial(pos, table, taps, weights), partial(vit_kernels.pos_embed, table, taps, weights),
             n * width * (4 * 2 + 4) + n * 4 * 12),  # 4 gathered bf16 rows, the float32 row out, taps and weights
        )  # fmt: skip
        for what, compiled, kernel, moved in cases:
            firsts = (first_call_s(compiled), first_call_s(kernel))
            got, want = kernel(), compiled()
            pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
            diff = max(float((g.float() - w.float()).abs().max()) for g, w in pairs)
            ms = [cuda_ms(fn, 50) for fn in (compiled, kernel)]
            print(f"| {what} | {name} | {ms[0]:.4f} | {ms[1]:.4f} | {moved / ms[1] / 1e6:.0f} | {moved / ms[0] / 1e6:.0f} "
                  f"| {firsts[0]:.2f} / {firsts[1]:.2f} | {diff:.3g} |")


if __name__ == "__main__":
    main()
