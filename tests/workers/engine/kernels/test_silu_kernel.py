"""The Triton SiLU*up kernel (the MLPs' fused path on CUDA) checked on the CPU through Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

from tests.workers.engine.kernels.kernel_check import run_kernel_check

CHECK = """
import torch
import torch.nn.functional as F
from workers.engine.kernels import silu_kernel
from workers.engine.kernels.skinny_gemm import Partials

gen = torch.Generator().manual_seed(0)
# Widths around the 1024-column block (the ViT's padded 3424, a partial last block, one exact block), one row and
# none; bf16 as served, float32 to see the math itself.
for rows, width, dtype in ((5, 3424, torch.bfloat16), (1, 2500, torch.bfloat16), (3, 1024, torch.float32),
                           (4, 700, torch.float32), (0, 1024, torch.bfloat16)):
    x = (4 * torch.randn(rows, 2 * width, generator=gen)).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    want = (F.silu(gate) * up).to(dtype)  # float32 math, rounded once, as the kernel does
    got = silu_kernel.silu_mul(x)
    assert got.shape == (rows, width) and got.dtype == dtype, (got.shape, got.dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)  # one bf16 ulp
    torch.testing.assert_close(got, want, **tol)
# Strided rows (a column block of a wider projection, as the joined router / shared-expert matmul gives: read in
# place at the row stride), at either end of the row, and a transposed input (copied first).
wide = torch.randn(3, 3 * 1024 + 7, generator=gen)
for view in (wide[:, : 2 * 1024], wide[:, 1024 + 7 :], wide[:, :2048].t().contiguous().t()):
    torch.testing.assert_close(silu_kernel.silu_mul(view), F.silu(view[:, :1024]) * view[:, 1024:])
# A split-K gate_up's float32 partials (FP8's decode GEMM splits it in 2), with and without a bias: summed in the
# kernel, the same bits as the sum pass followed by the kernel.
# 64 rows: FP8's decode kernel takes decode batches up to fp8_gemm.W8A16_MAX_ROWS.
for split, rows, width, bias in ((2, 1, 2500, True), (4, 3, 1024, False), (1, 2, 700, True), (2, 64, 300, True)):
    parts = 3 * torch.randn(split, rows, 2 * width, generator=gen)
    b = torch.randn(2 * width, generator=gen).to(torch.bfloat16) if bias else None
    product = Partials(parts, b, torch.bfloat16)
    got = silu_kernel.silu_mul(product)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, width)
    assert torch.equal(got, silu_kernel.silu_mul(product.settle()))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the fused MLP tests run the kernel itself")
def test_kernel_matches_eager_math_in_triton_interpreter() -> None:
    run_kernel_check(CHECK, "silu_kernel", "bfloat16", timeout=300)


def test_probe_turns_the_kernel_off_when_it_cannot_run() -> None:
    from workers.engine.kernels import silu_kernel

    # On the CPU without the interpreter, Triton cannot launch: the probe must say so instead of raising.
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.skip("the kernel can run here")
    try:
        assert silu_kernel.probe(torch.device("cpu"), torch.float32) is False
        assert silu_kernel.SWITCH.broken and not silu_kernel.available()
    finally:
        silu_kernel.SWITCH.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_partials_give_the_sum_pass_bits_on_cuda() -> None:
    """Block-FP8's split-K gate_up at decode rows (Qwen3-VL-8B: 2 splits of 2 x 12,288 columns), with a bias: the
    kernel's own sum is the sum pass's, bit for bit."""
    from workers.engine.kernels import silu_kernel
    from workers.engine.kernels.skinny_gemm import Partials

    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (1, 16):
        parts = 3 * torch.randn(2, rows, 2 * 12288, device="cuda", generator=gen)
        bias = torch.randn(2 * 12288, device="cuda", generator=gen).bfloat16()
        product = Partials(parts, bias, torch.bfloat16)
        assert torch.equal(silu_kernel.silu_mul(product), silu_kernel.silu_mul(product.settle()))
