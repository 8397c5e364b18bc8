"""SiLU(gate) * up, the MLPs' elementwise pass: eager, torch.compile (fused.silu_mul) and the Triton kernel.

    python -m benchmarks.kernels.silu_bench

Shapes of Qwen2.5-VL-7B's LM (I = 18,944) at a decode batch, a 4,096-token mixed step and one 8 x 1080p prompt,
and of its ViT (I = 3,420 padded to 3,424) for one 1080p image. bf16 on the GPU. Prints ms per call, the bandwidth
over the bytes the pass must move (read [T, 2I], write [T, I]) and the largest difference from eager.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.args import parser
from benchmarks.engine.vit_bench import cuda_ms
from workers.engine.kernels import fused, silu_kernel

SHAPES = (("LM decode", 64, 18944), ("LM chunk", 4096, 18944), ("LM 8 x 1080p", 21632, 18944), ("ViT 1080p", 10764, 3424))


def eager(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def main() -> None:
    parser(__doc__).parse_args()  # no flags: --help prints the docstring
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | tokens x I | eager ms | compiled ms | Triton ms | Triton GB/s | compiled GB/s | max diff vs eager |")
    print("|---|---|---|---|---|---|---|---|")
    compiled = fused.compiled(fused.silu_mul)
    for name, rows, width in SHAPES:
        x = torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16)
        ref = eager(x)
        diff = (silu_kernel.silu_mul(x).float() - ref.float()).abs().max().item()
        ms = [cuda_ms(partial(fn, x), 30) for fn in (eager, compiled, silu_kernel.silu_mul)]
        moved = 3 * rows * width * 2
        print(
            f"| {name} | {rows} x {width} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[2]:.3f} | {moved / ms[2] / 1e6:.0f} "
            f"| {moved / ms[1] / 1e6:.0f} | {diff:.3g} |"
        )


if __name__ == "__main__":
    main()
