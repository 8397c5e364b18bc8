"""The Triton skinny GEMM (decode projections on CUDA) checked on the CPU through Triton's interpreter.

The interpreter's tl.dot mishandles bfloat16 inputs (it returns garbage for any tile), so the checks run in
float16 and float32; the GPU path in bf16 is compared with cuBLAS by benchmarks/kernels/skinny_gemm_bench.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.workers.engine.kernels.kernel_check import run_kernel_check
from workers.engine.kernels import skinny_gemm
from workers.engine.layers import linear as layers

CHECK = """
import torch
import torch.nn.functional as F
from workers.engine.kernels import skinny_gemm
from workers.engine.kernels.skinny_gemm import Tile

gen = torch.Generator().manual_seed(0)
# (rows, out features, in features, bias, tile): one row and a full 16-row block; output features that end inside a
# block; K that ends inside a BLOCK_K and inside a split; no split, and splits of 2 and 4 (the partial + sum pass).
CASES = [
    (1, 200, 512, True, Tile(64, 128, 1, 4, 2)),
    (16, 96, 1024, False, Tile(32, 128, 4, 4, 2)),
    (5, 130, 700, True, Tile(32, 128, 2, 4, 2)),
    (3, 64, 3000, True, Tile(32, 256, 4, 4, 2)),
    (2, 48, 384, False, None),  # the kernel's own tile choice
]
for dtype in (torch.float32, torch.float16):
    for rows, n, k, bias, tile in CASES:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if bias else None
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        got = skinny_gemm.linear(x, w, b, use=tile)
        assert got.shape == (rows, n) and got.dtype == dtype, (got.shape, got.dtype)
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(got.float(), want, **tol)
# Leading dimensions are kept, and a split's partial sums add up in a fixed order: the same input twice gives
# the same bits.
x = torch.randn(2, 3, 256, generator=gen)
w = torch.randn(40, 256, generator=gen)
once = skinny_gemm.linear(x, w, use=Tile(32, 64, 2, 4, 2))
torch.testing.assert_close(once, F.linear(x, w), rtol=1e-4, atol=1e-4)
assert once.shape == (2, 3, 40) and torch.equal(once, skinny_gemm.linear(x, w, use=Tile(32, 64, 2, 4, 2)))
assert skinny_gemm.linear(torch.zeros(0, 256), w).shape == (0, 40)
"""


def test_kernel_matches_linear_under_the_interpreter() -> None:
    run_kernel_check(CHECK, "skinny_gemm", "float16")


def test_tiles_fill_the_card() -> None:
    # Weights with two strips per SM stream whole rows of K (a 7B's gate_up, the 27B's 16,480-row in_proj, whose
    # split in two took 23% longer on an H200); narrow ones split K until there are ~3 programs per SM or another
    # halving would no longer divide K into whole blocks.
    for n, k in ((37888, 3584), (16480, 5120), (248320, 5120)):
        t = skinny_gemm.tile(n, k, 132)
        assert t.split_k == 1 and -(-n // t.block_n) >= 2 * 132 and k % t.block_k == 0, (n, k, t)
    for n, k in ((3584, 18944), (3584, 3584), (1792, 9472)):
        t = skinny_gemm.tile(n, k, 132)
        assert t.split_k > 1 and k % (t.split_k * t.block_k) == 0
        assert -(-n // t.block_n) * t.split_k >= 3 * 132 or k % (2 * t.split_k * t.block_k), (n, k, t)
    # Qwen3-VL-8B's down and o, the 7B's down and the 27B's: K in 4 (8 was slower than cuBLAS on the 8B's)
    narrow = ((4096, 12288), (4096, 4096), (3584, 18944), (5120, 17408))
    assert {skinny_gemm.tile(n, k, 132).split_k for n, k in narrow} == {4}


def test_only_cuda_decode_rows_of_large_weights_take_it() -> None:
    big = torch.empty(skinny_gemm.MIN_WEIGHT_BYTES // 2, 1, dtype=torch.bfloat16, device="meta")
    small = torch.empty(8, 8, dtype=torch.bfloat16, device="meta")
    x = torch.empty(1, 1, dtype=torch.bfloat16)
    assert not skinny_gemm.wanted(x, big)  # the CPU keeps F.linear (the exactness tests' path)
    # CPU path unchanged: layers.linear is F.linear, bit for bit
    gen = torch.Generator().manual_seed(1)
    xs, ws, bs = (
        torch.randn(3, 32, generator=gen),
        torch.randn(16, 32, generator=gen),
        torch.randn(16, generator=gen),
    )
    assert torch.equal(layers.linear(xs, ws, bs), F.linear(xs, ws, bs))
    if torch.cuda.is_available():
        xc = torch.empty(1, 1, dtype=torch.bfloat16, device="cuda")
        assert not skinny_gemm.wanted(xc, small)
        assert not skinny_gemm.wanted(
            torch.empty(skinny_gemm.MAX_ROWS + 1, 1, dtype=torch.bfloat16, device="cuda"), big
        )
