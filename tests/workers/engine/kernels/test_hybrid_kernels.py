"""Qwen3.5's elementwise Triton kernels (hybrid_kernels.py): on the CPU through Triton's interpreter against the
compiled sites' eager definitions (fused.py), on a GPU against eager and the compiled sites."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.kernels.kernel_check import check_switch_turns_it_off, run_kernel_check

CHECK = """
import torch
from workers.engine.kernels import fused, hybrid_kernels as hk

gen = torch.Generator().manual_seed(0)


def rounds_as_eager(got, want):
    # half precision: eager's intermediate roundings kept, so only a float32 sum's order may flip a last bit
    if got.dtype == torch.float16:
        assert int((got != want).sum()) <= 1 + got.numel() // 1000


# The gated attention's q (read in place from q_proj's [query | gate] rows) and k: the 9B's 16 / 4 heads of 256 with a
# rotary of 64, a TP rank's 3 / 1 heads of 48 with a rotary of 16, full rotary on heads of 16; float32 to see the math,
# float16 as served.
for t, hq, hkv, d, r in ((3, 16, 4, 256, 64), (4, 3, 1, 48, 16), (1, 2, 2, 16, 16)):
    for dtype in (torch.float32, torch.float16):
        qkv = (2 * torch.randn(t, (2 * hq + 2 * hkv) * d, generator=gen)).to(dtype)
        q_gate = qkv[:, : 2 * hq * d].view(t, hq, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:]
        k = qkv[:, 2 * hq * d : (2 * hq + hkv) * d].view(t, hkv, d)
        q_w, k_w = (torch.rand(d, generator=gen) + 0.5).to(dtype), (torch.rand(d, generator=gen) + 0.5).to(dtype)
        angles = torch.rand(t, r, generator=gen) * 50
        cos = angles.cos().to(dtype).unsqueeze(1)
        sin = torch.cat((-angles[:, : r // 2].sin(), angles[:, r // 2 :].sin()), dim=-1).to(dtype).unsqueeze(1)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=2e-3)
        got = hk.qk_norm_partial_rope(q, k, q_w, k_w, 1e-6, cos, sin, r)
        want = fused.qk_norm_partial_rope(q, k, q_w, k_w, 1e-6, cos, sin, r)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == dtype and g.is_contiguous()
            torch.testing.assert_close(g, w, **tol)
        attn = torch.randn(t, hq, d, generator=gen).to(dtype)
        out = hk.gated_output(attn, gate)
        assert out.shape == (t, hq * d) and out.is_contiguous()
        torch.testing.assert_close(out, fused.gated_output(attn, gate), **tol)
        rounds_as_eager(out, fused.gated_output(attn, gate))
# Gated DeltaNet: the output norm over value heads (x the delta rule's [T, Hv, Dv], the gate a strided view of the
# in-projection) and the gates (a and b columns of it): the 27B's 48 value heads (off a power of two) of 128, a small one
for t, hv, dv in ((5, 48, 128), (2, 3, 16)):
    for dtype in (torch.float32, torch.float16):
        proj = torch.randn(t, 2 * hv * dv + 2 * hv + 3, generator=gen).to(dtype)
        x = torch.randn(t, hv, dv, generator=gen).to(dtype)
        z = proj[:, : hv * dv].view(t, hv, dv)
        w = (torch.rand(dv, generator=gen) + 0.5).to(dtype)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=2e-3)
        got = hk.gated_rms_norm(x, z, w, 1e-6)
        assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
        torch.testing.assert_close(got, fused.gated_rms_norm(x, z, w, 1e-6), **tol)
        rounds_as_eager(got, fused.gated_rms_norm(x, z, w, 1e-6))
        proj[0, hv * dv] = 30.0  # softplus's both branches: one a + dt_bias beyond 20
        a = proj[:, hv * dv : hv * dv + hv]
        b = proj[:, hv * dv + hv : hv * dv + 2 * hv]
        a_log, dt_bias = torch.rand(hv, generator=gen) * 2, torch.randn(hv, generator=gen)
        g, beta = hk.delta_gates(a, b, a_log, dt_bias)
        g_ref, beta_ref = fused.delta_gates(a, b, a_log, dt_bias)
        assert g.dtype == torch.float32 and beta.dtype == dtype and g.is_contiguous() and beta.is_contiguous()
        assert bool(((a.float() + dt_bias) > 20).any())
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(beta, beta_ref, **tol)
# a decay of nearly 1 (a + dt_bias far below 0): log1p's accuracy, not 0
g, _ = hk.delta_gates(torch.full((1, 4), -30.0), torch.zeros(1, 4), torch.zeros(4), torch.zeros(4))
assert bool((g < 0).all())
torch.testing.assert_close(g, fused.delta_gates(torch.full((1, 4), -30.0), torch.zeros(1, 4), torch.zeros(4),
                                                torch.zeros(4))[0], rtol=1e-5, atol=0)
# no rows
assert hk.gated_output(torch.zeros(0, 2, 8), torch.zeros(0, 2, 8)).shape == (0, 16)
assert hk.delta_gates(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(3), torch.zeros(3))[0].shape == (0, 3)
# an attention output as [T, H*D] rows, a gate whose inner dimension is strided (copied first)
attn, gate = torch.randn(2, 2 * 8, generator=gen), torch.randn(2, 8, 2, generator=gen).transpose(1, 2)
torch.testing.assert_close(hk.gated_output(attn, gate), fused.gated_output(attn.view(2, 2, 8), gate))
"""


def test_kernels_match_the_sites_under_the_interpreter() -> None:
    run_kernel_check(CHECK, "hybrid_kernels", "float16")


def test_switch_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine.kernels import hybrid_kernels

    check_switch_turns_it_off(monkeypatch, hybrid_kernels)
    assert not hybrid_kernels.wanted(torch.zeros(2, 3))  # and a CPU tensor never takes them


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU runs the interpreter)")
def test_kernels_match_eager_on_cuda() -> None:
    """The 9B shape's gated attention at a 4,096-token chunk and its Gated DeltaNet (32 value heads of 128), bf16,
    against eager (transformers' math, whose bf16 roundings the kernels keep) and the compiled fallback near it."""
    from workers.engine.kernels import fused, hybrid_kernels as hk

    assert hk.probe(torch.device("cuda"), torch.bfloat16), hk.SWITCH.why_off()
    t, hq, hkv, d, r, hv, dv = 4096, 16, 4, 256, 64, 32, 128
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16()

    qkv = rand(t, (2 * hq + 2 * hkv) * d)
    q_gate = qkv[:, : 2 * hq * d].view(t, hq, 2 * d)
    q, gate, k = q_gate[..., :d], q_gate[..., d:], qkv[:, 2 * hq * d : (2 * hq + hkv) * d].view(t, hkv, d)
    q_w, k_w, cos, sin, attn = rand(d) * 0.1 + 1, rand(d) * 0.1 + 1, rand(t, 1, r), rand(t, 1, r), rand(t, hq, d)
    proj = rand(t, hv * dv + 2 * hv)
    x, z, w = rand(t, hv, dv), proj[:, : hv * dv].view(t, hv, dv), rand(dv) * 0.1 + 1
    a, b = proj[:, hv * dv : hv * dv + hv], proj[:, hv * dv + hv :]
    a_log, dt_bias = torch.rand(hv, device="cuda", generator=gen), torch.randn(hv, device="cuda", generator=gen)
    args = {
        "qk_norm_partial_rope": (q, k, q_w, k_w, 1e-6, cos, sin, r),
        "gated_output": (attn, gate),
        "gated_rms_norm": (x, z, w, 1e-6),
        "delta_gates": (a, b, a_log, dt_bias),
    }
    for name, site_args in args.items():
        outs = [getattr(hk, name)(*site_args), getattr(fused, name)(*site_args),
                fused.compiled(getattr(fused, name))(*site_args)]  # fmt: skip
        for got, eager, compiled in zip(*[o if isinstance(o, tuple) else (o,) for o in outs], strict=True):
            assert got.dtype == eager.dtype and got.shape == eager.shape, name
            diff, scale = (got.float() - eager.float()).abs(), float(eager.abs().max())
            if got.dtype == torch.float32:  # the decay: float32 throughout
                assert float(diff.max()) <= 1e-5 * scale, name
                continue
            # eager's roundings kept: only a float32 reduction's order may flip a last bit, and rarely
            assert float((diff > 0).float().mean()) < 1e-3 and float(diff.max()) <= 2**-7 * scale, name
            # the fallback is within bf16's last bits of it (Inductor drops eager's intermediate roundings)
            assert float((compiled.float() - eager.float()).abs().max()) <= 2**-6 * scale, name
