"""The FP8 arithmetic (fp8_quant.py) and GEMM variants (fp8_gemm.py): exact round trips of the published layouts on
any device, the row-wise ``torch._scaled_mm`` on the CPU against the same arithmetic written out, and on a GPU each
native kernel against the dequantized bf16 GEMM."""

from __future__ import annotations

import pytest
import torch

from workers.engine.kernels import fp8_gemm, fused
from workers.engine.kernels.fp8_quant import (
    FP8,
    FP8_MAX,
    dequantize,
    quantize_block,
    quantize_rows,
    quantize_token_groups,
    quantize_tokens,
)

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)  # rows of different scales


def test_block_scales_have_the_published_shape_and_each_tile_reaches_448() -> None:
    q, s = quantize_block(weight(300, 200))
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (3, 2)  # ceil(300/128), ceil(200/128)
    tile = q[128:256, 0:128].float().abs().max()
    edge = q[256:300, 128:200].float().abs().max()  # a partial tile is scaled on its own values
    assert tile == FP8_MAX and edge == FP8_MAX


def test_requantizing_a_dequantized_weight_gives_back_its_fp8_values() -> None:
    """What fp8_layers.py relies on: the CUDA layers re-made from the loader's dequantized weights hold the
    checkpoint's FP8 values, for both layouts, also after rounding the dequantized weight to bf16."""
    for quantize in (quantize_block, quantize_rows):
        q, s = quantize(weight(256, 384, seed=1))
        for dtype in (torch.float32, torch.bfloat16):
            again, s2 = quantize(dequantize(q, s).to(dtype))
            assert torch.equal(again.float(), q.float())
            assert torch.allclose(s2, s, rtol=2**-8)


def test_activation_quantization_per_token_and_per_group() -> None:
    x = weight(4, 256, seed=2)
    q, s = quantize_tokens(x)
    assert s.shape == (4, 1) and torch.allclose(q.float() * s, x, rtol=0.07, atol=1e-3)
    g, gs = quantize_token_groups(x, 128)
    assert gs.shape == (4, 2)
    assert torch.equal(g[:, 128:].float().abs().amax(dim=1), torch.full((4,), FP8_MAX))
    assert torch.allclose(g.float().view(4, 2, 128) * gs[..., None], x.view(4, 2, 128), rtol=0.07, atol=1e-3)


@pytest.mark.parametrize("rows", [40, 97])
def test_compiled_activation_quantization_is_the_eager_one_bit_for_bit(rows: int) -> None:
    """What the CUDA GEMMs run from COMPILED_QUANT_MIN_ROWS rows (one compiled kernel, fused.py), compiled here on the
    CPU: the same fp8 values and scales as the eager ops, bf16 and float32 inputs, the block scales token-major."""
    for dtype in (torch.bfloat16, torch.float32):
        x = (weight(rows, 384, seed=7) * 30).to(dtype)
        x[3, :128] = 0  # a zero group keeps a finite scale
        for fn in (quantize_tokens, fp8_gemm.fp8_block_activations):
            (q, s), (cq, cs) = fn(x), fused.compiled(fn)(x)
            assert torch.equal(cq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(cs, s)
            assert cs.stride() == s.stride()
    _, scales = fp8_gemm.fp8_block_activations(x)
    assert scales.shape == (rows, 3) and scales.stride() == (1, rows)


def test_rowwise_scaled_mm_equals_the_quantized_operands_multiplied_out() -> None:
    """torch._scaled_mm runs row-wise FP8 on the CPU too: the kernel equals (x_q * s_x) (w_q * s_w)^T."""
    x = weight(6, 256, seed=3).to(torch.bfloat16)
    q, s = quantize_rows(weight(96, 256, seed=4))
    qx, sx = quantize_tokens(x)
    expected = (qx.float() * sx) @ (q.float() * s).t()
    got = fp8_gemm.rowwise_linear(x, q, s)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)


def test_linear_takes_the_dequantized_gemm_on_cpu_for_both_layouts() -> None:
    x = weight(3, 256, seed=5)
    w = weight(128, 256, seed=6)
    for q, s in (quantize_block(w), quantize_rows(w)):
        assert fp8_gemm.native_kernel(x, q, s) is None
        got = fp8_gemm.linear(x.view(1, 3, 256), q, s)
        assert got.shape == (1, 3, 128)
        torch.testing.assert_close(got[0], x @ dequantize(q, s).t())


def test_probe_keeps_a_kernel_that_computes_the_product_and_drops_one_that_cannot_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fp8_gemm, "_probed", {})
    monkeypatch.setattr(fp8_gemm, "_chosen_layout", {})
    cpu = torch.device("cpu")
    assert fp8_gemm.probe("rowwise", cpu)  # torch._scaled_mm runs row-wise on the CPU too
    assert not fp8_gemm.probe("block", cpu) and "block" not in fp8_gemm._chosen_layout  # no block recipe there
    assert "FP8 block GEMM unusable on cpu" in caplog.text
    monkeypatch.setattr(fp8_gemm, "rowwise_linear", lambda x, q, s, bias=None: fp8_gemm.dequant_linear(x, q, s) * 2)
    monkeypatch.setattr(fp8_gemm, "_probed", {})
    assert not fp8_gemm.probe("rowwise", cpu)  # a kernel computing the wrong product is not used


def test_variant_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fp8_gemm.VARIANT_ENV, raising=False)
    assert fp8_gemm.variant() == "auto"  # FP8 layers where the GPU has FP8 (measured faster than bf16 there)
    assert not fp8_gemm.wants_fp8_layers(torch.device("cpu"))  # the CPU keeps the dequantized weights
    monkeypatch.setenv(fp8_gemm.VARIANT_ENV, "bf16")
    assert fp8_gemm.variant() == "bf16" and not fp8_gemm.wants_fp8_layers(torch.device("cpu"))
    monkeypatch.setenv(fp8_gemm.VARIANT_ENV, "fast")
    with pytest.raises(ValueError, match="GLIMPSE_FP8_GEMM='fast': choose one of auto, w8a16, dequant, bf16"):
        fp8_gemm.variant()


# FP8 GEMMs quantize the activations too: against the bf16 GEMM of the dequantized weight the error is that
# quantization's (e4m3: 3 mantissa bits, ~2^-4 relative per element), averaged over K. Stated bound: 3% of the
# output's RMS, per element, for K >= 256.
GPU_TOLERANCE = 0.03


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a Hopper-class CUDA device")
@pytest.mark.parametrize("m", [1, 16, 512])
def test_native_kernels_match_the_dequantized_gemm_on_gpu(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fp8_gemm.VARIANT_ENV, "auto")  # the default (bf16) has no native kernel
    x = weight(m, 1024, seed=7).to("cuda", torch.bfloat16)
    w = weight(2048, 1024, seed=8).cuda()
    qb, sb = quantize_block(w)
    cases = ((qb, sb, "block"), (qb, sb.repeat_interleave(128, dim=0), "row-block"), (*quantize_rows(w), "rowwise"))
    for q, s, kernel in cases:
        assert fp8_gemm.native_kernel(x, q, s) == kernel  # its probe passed
        ref = fp8_gemm.dequant_linear(x, q, s).float()
        got = (fp8_gemm.rowwise_linear if kernel == "rowwise" else fp8_gemm.block_linear)(x, q, s).float()
        assert (got - ref).pow(2).mean().sqrt() <= GPU_TOLERANCE * ref.pow(2).mean().sqrt(), kernel
        # and per output row (each over 2,048 columns, so a scale read from the wrong block shows in its rows; a
        # bound on the single worst element was luck: 2.0 and 2.75 against an RMS of ~10 failed it on an H200)
        rows = (got - ref).pow(2).mean(dim=1).sqrt() / ref.pow(2).mean(dim=1).sqrt().clamp(min=1e-6)
        assert float(rows.max()) <= 2 * GPU_TOLERANCE, (kernel, float(rows.max()))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a Hopper-class CUDA device")
def test_grouped_fp8_gemm_matches_the_per_expert_reference_on_gpu() -> None:
    rows = weight(40, 256, seed=9).to("cuda", torch.bfloat16)
    q, s = quantize_rows(torch.stack([weight(128, 256, seed=10 + e) for e in range(4)]).cuda())
    offs = torch.tensor([5, 5, 31, 40], dtype=torch.int32, device="cuda")  # one expert gets no rows
    got = fp8_gemm.grouped_mm(rows, q, s, offs).float()
    ref = fp8_gemm.grouped_reference(rows, q, s, offs).float()
    assert (got - ref).pow(2).mean().sqrt() <= GPU_TOLERANCE * ref.pow(2).mean().sqrt()
