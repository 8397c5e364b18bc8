"""The split-K sum folded into the next residual add and RMSNorm (split_norm.py), checked on the CPU through
Triton's interpreter against the sum pass and the eager norm, and the layers that hand it their partials."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.kernels.kernel_check import check_switch_turns_it_off, run_kernel_check
from workers.engine.kernels import split_norm
from workers.engine.layers.linear import RowParallelLinear
from workers.engine.models.decoder_layers import DecoderLayer, SwiGLUMLP

CHECK = """
import torch
import torch.nn.functional as F
from workers.engine.kernels import skinny_gemm, split_norm
from workers.engine.kernels.skinny_gemm import Partials, Tile
from workers.engine.layers.linear import RMSNorm

gen = torch.Generator().manual_seed(0)
# (rows, hidden, in features, split): one row and a full 16-row block; a hidden size that is not a power of two
# (the kernel's block is padded), splits of 2, 4 and 8.
CASES = [(1, 256, 512, 4), (16, 96, 1024, 2), (5, 320, 2048, 8)]
for dtype in (torch.float32, torch.float16):
    for rows, n, k, split in CASES:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
        residual = torch.randn(rows, n, generator=gen).to(dtype)
        norm = RMSNorm(n, 1e-6).to(dtype)
        norm.weight.copy_(1 + torch.randn(n, generator=gen) / 8)
        delta = skinny_gemm.unsummed(x, w, use=Tile(32, 128, split, 4, 2))
        assert isinstance(delta, Partials) and delta.parts.shape == (split, rows, n), type(delta)
        summed = delta.settle()
        assert torch.equal(summed, skinny_gemm.linear(x, w, use=Tile(32, 128, split, 4, 2)))
        total, normed = split_norm.add_rms_norm(residual, delta, norm.weight, norm.eps)
        want_total, want = norm.add(residual, summed)  # the eager add and norm on the summed product
        # the kernel sums the splits in its own fixed order: the last bits may differ from the sum pass's
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=2e-3)
        torch.testing.assert_close(total, want_total, **tol)
        torch.testing.assert_close(normed, want, **tol)
        # the same partials twice give the same bits (the order does not depend on timing)
        again = split_norm.add_rms_norm(residual, delta, norm.weight, norm.eps)
        assert torch.equal(again[0], total) and torch.equal(again[1], normed)
        # RMSNorm.add takes the partials itself: fused, through the kernel; eager, summed first
        norm.fused = True
        assert torch.equal(norm.add(residual, delta)[0], total)
        norm.fused = False
        assert all(torch.equal(a, b) for a, b in zip(norm.add(residual, delta), (want_total, want)))
# 64 rows, a program each: FP8's decode kernel splits K for decode batches up to fp8_gemm.W8A16_MAX_ROWS
parts = torch.randn(2, 64, 96, generator=gen)
residual = torch.randn(64, 96, generator=gen)
total, _ = split_norm.add_rms_norm(residual, Partials(parts, None, torch.float32), torch.ones(96), 1e-6)
torch.testing.assert_close(total, residual + parts.sum(0), rtol=1e-5, atol=1e-5)
# 3 splits (a forced tile's) load one at a time: the loads' count must be a power of two
parts = torch.randn(3, 2, 96, generator=gen)
residual = torch.randn(2, 96, generator=gen)
total, _ = split_norm.add_rms_norm(residual, Partials(parts, None, torch.float32), torch.ones(96), 1e-6)
torch.testing.assert_close(total, residual + parts.sum(0), rtol=1e-5, atol=1e-5)
# 16 splits of a 4,096-wide row take two loads of 8 (what one program holds at once)
parts = torch.randn(16, 2, 4096, generator=gen)
residual, weight = torch.randn(2, 4096, generator=gen), torch.ones(4096)
delta = Partials(parts, None, torch.float32)
total, normed = split_norm.add_rms_norm(residual, delta, weight, 1e-6)
torch.testing.assert_close(total, residual + parts.sum(0), rtol=1e-5, atol=1e-5)
torch.testing.assert_close(normed, RMSNorm(4096).add(residual, delta.settle())[1], rtol=1e-5, atol=1e-5)
# a bias rides with the partials and is added after their sum, as the sum pass adds it
x, w = torch.randn(3, 512, generator=gen), torch.randn(64, 512, generator=gen) / 16
bias, residual, weight = torch.randn(64, generator=gen), torch.randn(3, 64, generator=gen), torch.ones(64)
delta = skinny_gemm.unsummed(x, w, bias, use=Tile(32, 128, 4, 4, 2))
assert isinstance(delta, Partials)
torch.testing.assert_close(split_norm.add_rms_norm(residual, delta, weight, 1e-6)[0], residual + F.linear(x, w, bias))
# no split: the product comes back summed, as linear returns it
plain = skinny_gemm.unsummed(x, w, use=Tile(32, 128, 1, 4, 2))
assert isinstance(plain, torch.Tensor) and torch.equal(plain, skinny_gemm.linear(x, w, use=Tile(32, 128, 1, 4, 2)))
"""


ROWS_CHECK = """
import torch
from workers.engine.kernels import split_norm
from workers.engine.layers.linear import RMSNorm

gen = torch.Generator().manual_seed(4)
# (rows, width): one row; a width that is not a power of two (the block is padded and masked); 300 rows of programs
for dtype in (torch.float32, torch.float16):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=2e-3)
    for rows, n in ((1, 256), (7, 320), (300, 96)):
        x, delta = (torch.randn(rows, n, generator=gen).to(dtype) for _ in range(2))
        norm = RMSNorm(n, 1e-6).to(dtype)
        norm.weight.copy_(1 + torch.randn(n, generator=gen) / 8)
        assert split_norm.rows_usable(x, norm.weight, delta)
        want_total, want = norm.add(x, delta)  # the eager add and norm (norm.fused is off: the CPU's path)
        total, normed = split_norm.add_rms_norm_rows(x, delta, norm.weight, norm.eps)
        assert torch.equal(total, want_total)  # one add rounded once, as torch's
        torch.testing.assert_close(normed, want, **tol)
        torch.testing.assert_close(split_norm.rms_norm_rows(x, norm.weight, norm.eps), norm(x), **tol)
        # the inputs are left as they were, and a plain norm returns a new tensor
        assert torch.equal(x + delta, want_total)
        assert split_norm.rms_norm_rows(x, norm.weight, norm.eps).data_ptr() != x.data_ptr()
# a strided view of rows (a slice of wider rows) is read as its values
wide = torch.randn(4, 160, generator=gen)
view, weight = wide[:, :96], torch.ones(96)
torch.testing.assert_close(split_norm.rms_norm_rows(view, weight, 1e-6), RMSNorm(96)(view.contiguous()))
# operands it does not take: a float32 weight on half rows (torch's norm would answer in float32), 3-D rows, a delta of
# another dtype, rows wider than a program holds
half = torch.randn(3, 64, generator=gen).half()
assert not split_norm.rows_usable(half, torch.ones(64))
assert not split_norm.rows_usable(half.view(3, 4, 16), torch.ones(16).half())
assert not split_norm.rows_usable(half, torch.ones(64).half(), half.float())
assert not split_norm.rows_usable(torch.zeros(1, split_norm.MAX_WIDTH + 1), torch.ones(split_norm.MAX_WIDTH + 1))
assert split_norm.probe_rows(torch.device("cpu"), torch.float16) and not split_norm.ROWS_SWITCH.broken
"""


def test_kernel_matches_the_sum_pass_and_the_norm_under_the_interpreter() -> None:
    run_kernel_check(CHECK, "split_norm", "float16")


def test_rows_kernel_matches_the_eager_add_and_norm_under_the_interpreter() -> None:
    run_kernel_check(ROWS_CHECK, "split_norm", "float16")


def test_rows_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, 32)
    check_switch_turns_it_off(
        monkeypatch, split_norm, split_norm.ROWS_SWITCH,
        lambda: split_norm.rows_available() or split_norm.rows_usable(x, torch.ones(32)), split_norm.probe_rows,
    )  # fmt: skip


def test_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    check_switch_turns_it_off(monkeypatch, split_norm)


def test_cpu_projections_into_the_norm_are_the_plain_ones() -> None:
    # The CPU (the exactness tests' path) never splits: into_norm is forward, bit for bit.
    gen = torch.Generator().manual_seed(2)
    proj = RowParallelLinear(64, 32, bias=False)
    proj.weight.copy_(torch.randn(32, 64, generator=gen))
    x = torch.randn(5, 64, generator=gen)
    got = proj.into_norm(x)
    assert isinstance(got, torch.Tensor) and torch.equal(got, proj(x))


def test_only_a_dense_mlp_before_a_norm_leaves_its_sum() -> None:
    mlp = SwiGLUMLP(32, 64)
    assert not mlp.into_norm  # alone (e.g. Qwen3.5's shared expert, scaled by its gate) it sums
    DecoderLayer(torch.nn.Identity(), mlp, 32, 1e-6)
    assert mlp.into_norm
    moe = torch.nn.Linear(32, 32)
    DecoderLayer(torch.nn.Identity(), moe, 32, 1e-6)
    assert not hasattr(moe, "into_norm")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_split_projection_into_its_norm_on_cuda() -> None:
    """bf16 on the GPU: an o projection whose decode GEMM splits K hands RMSNorm.add its partials, and the one kernel
    gives the sum pass and compiled norm's answer (within bf16's rounding)."""
    from workers.engine.kernels import skinny_gemm
    from workers.engine.kernels.skinny_gemm import Partials, Tile
    from workers.engine.layers.linear import RMSNorm

    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    proj, norm = RowParallelLinear(2048, 1024, bias=False).to(dev, dt), RMSNorm(1024).to(dev, dt)
    proj.weight.copy_(torch.randn(1024, 2048, generator=gen) / 45)
    norm.weight.copy_(1 + torch.randn(1024, generator=gen) / 8)
    norm.fused = True
    skinny_gemm.use_measured(1024, 2048, Tile(32, 128, 4, 4, 2))
    try:
        for rows in (1, 5, 16):
            x = torch.randn(rows, 2048, generator=gen).to(dev, dt)
            residual = torch.randn(rows, 1024, generator=gen).to(dev, dt)
            delta = proj.into_norm(x)
            assert isinstance(delta, Partials) and delta.parts.shape == (4, rows, 1024)
            total, normed = norm.add(residual, delta)
            want_total, want = norm.add(residual, delta.settle())
            torch.testing.assert_close(total, want_total, rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(normed, want, rtol=2e-2, atol=2e-2)
    finally:
        skinny_gemm._measured.pop((1024, 2048), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_norm_on_cuda_matches_the_compiled_one() -> None:
    """bf16 on the GPU: RMSNorm on plain rows (decode to a 4,096-token prefill step) through the kernel gives the
    compiled add and norm's answer within bf16's rounding, and the residual's sum exactly."""
    from workers.engine.kernels import fused
    from workers.engine.layers.linear import RMSNorm

    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    assert split_norm.probe_rows(dev, dt)
    for rows, n in ((1, 4096), (64, 3584), (4096, 4096), (3, 5376)):
        norm = RMSNorm(n).to(dev, dt)
        norm.weight.copy_(1 + torch.randn(n, generator=gen) / 8)
        x, delta = (torch.randn(rows, n, generator=gen).to(dev, dt) for _ in range(2))
        want_total, want = fused.compiled(fused.add_rms_norm)(x, delta, norm.weight, norm.eps)
        norm.fused = True
        assert split_norm.rows_usable(x, norm.weight, delta)
        total, normed = norm.add(x, delta)
        assert torch.equal(total, want_total)
        torch.testing.assert_close(normed, want, rtol=1.6e-2, atol=1.6e-2)
        torch.testing.assert_close(norm(x), fused.compiled(fused.rms_norm)(x, norm.weight, norm.eps), rtol=1.6e-2, atol=1.6e-2)
