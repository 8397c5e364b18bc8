"""Fused (torch.compile'd) elementwise kernels against the eager ops they replace, on CUDA.

In float32 the fused kernels must agree with eager to rounding; in bf16 they round once where eager rounds
after every op, so they may differ by a bf16 ulp or two, never more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.engine.kernels import fused
from workers.engine.layers.linear import RMSNorm
from workers.engine.layers.vision_attention import _rope
from workers.engine.layers.vision_mlp import VisionMLP
from workers.engine.models.qwen2_5_vl.lm import apply_rope, rope_tables

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


def test_enable_switches_only_the_fused_flags() -> None:
    norm, mlp = RMSNorm(8), VisionMLP(8, 12, F.silu)
    model = torch.nn.Sequential(norm, mlp, torch.nn.Linear(8, 8))
    assert fused.enable(model) == 2 and norm.fused and mlp.fused
    assert fused.enable(model, False) == 2 and not norm.fused and not mlp.fused


@cuda
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rms_norm_and_residual_add_on_cuda(dtype: torch.dtype, tol: float, tokens: int) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(256, 1e-6).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = torch.randn(tokens, 256, device="cuda", dtype=dtype) * 3
    delta = torch.randn_like(x)
    want, (want_sum, want_add) = norm(x), norm.add(x, delta)
    fused.enable(norm)
    got, (got_sum, got_add) = norm(x), norm.add(x, delta)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(got_sum, want_sum, atol=0, rtol=0)  # one add, one rounding either way
    torch.testing.assert_close(got_add, want_add, atol=tol, rtol=tol)


@cuda
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_lm_rope_matches_apply_rope_on_cuda(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    t, hq, hkv, d = 33, 8, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=dtype)
    angles = torch.rand(t, d, device="cuda") * 50
    cos, sin = rope_tables(angles.cos().to(dtype), angles.sin().to(dtype))
    q, k, v = fused.compiled(fused.lm_rope)(qkv, cos, sin, hq * d, hkv * d, d)
    q_ref, k_ref, v_ref = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    torch.testing.assert_close(q, apply_rope(q_ref.view(t, hq, d), cos, sin), atol=tol, rtol=tol)
    torch.testing.assert_close(k, apply_rope(k_ref.view(t, hkv, d), cos, sin), atol=tol, rtol=tol)
    assert torch.equal(v, v_ref.view(t, hkv, d)) and v.is_contiguous() and q.is_contiguous()


@cuda
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_vit_rope_matches_eager_rope_on_cuda(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    n, h, d = 130, 4, 80  # head_dim 80 as in Qwen2.5-VL's ViT
    qkv = torch.randn(n, 3, h, d, device="cuda", dtype=dtype)
    angles = torch.rand(n, d // 2, device="cuda") * 40
    q, k = fused.compiled(fused.vit_rope)(qkv, angles.cos(), angles.sin())
    q_ref, k_ref = _rope(qkv[:, :2], angles.cos()[:, None, None], angles.sin()[:, None, None])
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k, k_ref, atol=tol, rtol=tol)
    assert q.is_contiguous() and k.is_contiguous()


@cuda
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_packed_vision_mlp_fused_on_cuda(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    mlp = VisionMLP(64, 90, F.silu).to("cuda", dtype)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    x = torch.randn(57, 64, device="cuda", dtype=dtype)
    want = mlp(x)  # checkpoint layout, eager
    mlp.pack()
    fused.enable(mlp)
    torch.testing.assert_close(mlp(x), want, atol=tol, rtol=tol)


@cuda
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("tokens", [1, 9])
def test_gated_delta_net_norm_and_gates_on_cuda(dtype: torch.dtype, tol: float, tokens: int) -> None:
    """Qwen3.5's gated output norm and decay/write gates, compiled, against the eager layer's code."""
    from workers.engine.models.qwen3_5.linear_attention import GatedRMSNorm

    torch.manual_seed(0)
    norm = GatedRMSNorm(128, 1e-6).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x, gate = (torch.randn(tokens, 8, 128, device="cuda", dtype=dtype) * 3 for _ in range(2))
    want = norm(x, gate)
    norm.fused = True
    got = norm(x, gate)
    assert got.dtype == want.dtype and torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    a, b = (torch.randn(tokens, 8, device="cuda", dtype=dtype) for _ in range(2))
    a_log, dt_bias = torch.randn(8, device="cuda", dtype=dtype), torch.randn(8, device="cuda", dtype=dtype)
    g, beta = fused.compiled(fused.delta_gates)(a, b, a_log, dt_bias)
    want_g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    assert g.dtype == torch.float32 and torch.allclose(g, want_g, atol=1e-5, rtol=1e-5)
    # float32: Inductor's sigmoid may differ from eager's in the last bit (torch 2.11 on an H200 did at 9 tokens)
    torch.testing.assert_close(beta, b.sigmoid(), rtol=1e-6 if dtype == torch.float32 else 0, atol=0)


@cuda
@pytest.mark.parametrize("shape", [(300, 64, 96), (4096, 1152, 4304)])
def test_the_gemm_gelu_epilogue_is_the_tanh_gelu_on_cuda(shape: tuple[int, int, int]) -> None:
    """Qwen3-VL's tower runs its MLP's first projection as torch._addmm_activation(use_gelu=True): on CUDA (cuBLASLt's
    epilogue, or torch's fallback) that must be the tanh GELU of gelu_pytorch_tanh, not the erf one its CPU kernel
    computes; the inputs reach where the two differ by far more than the tolerance."""
    rows, inner, out = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, inner, device="cuda", generator=gen)
    w = torch.randn(out, inner, device="cuda", generator=gen) * inner**-0.5 * 2
    bias = torch.randn(out, device="cuda", generator=gen)
    for dtype, tol in ((torch.float32, 5e-5), (torch.bfloat16, 2e-2)):
        got = torch._addmm_activation(bias.to(dtype), x.to(dtype), w.to(dtype).t(), use_gelu=True).float()
        pre = torch.addmm(bias.to(dtype), x.to(dtype), w.to(dtype).t()).float()
        tanh, erf = F.gelu(pre, approximate="tanh"), F.gelu(pre)
        torch.testing.assert_close(got, tanh, atol=tol, rtol=tol)
        if dtype == torch.float32:  # the two GELUs differ by up to ~5e-4, far above float32's rounding
            assert (tanh - erf).abs().max() > 4 * tol
            assert (got - tanh).abs().mean() * 10 < (got - erf).abs().mean()
