"""The Triton rotary kernel for the LM's fused qkv (the CUDA path of fused.lm_rope): on the CPU through Triton's
interpreter against the eager rotary and fused.lm_rope's own math, and on a GPU against the compiled one."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.interpreted import run_interpreted

CHECK = """
import torch
from workers.engine import fused, rope_kernel
from workers.engine.models.qwen2_5_vl.lm import apply_rope, rope_tables

gen = torch.Generator().manual_seed(0)
# (tokens, query heads, KV heads, head_dim): a 7B's 28/4 of 128 (query heads not a power of two), one token, 3B's
# 16/2, and a tiny one; float32 to see the math, float16 as served (the interpreter's tl.dot-free path is exact).
for t, hq, hkv, d in ((7, 28, 4, 128), (1, 28, 4, 128), (4, 16, 2, 128), (3, 3, 1, 16)):
    for dtype in (torch.float32, torch.float16):
        qkv = (3 * torch.randn(t, (hq + 2 * hkv) * d, generator=gen)).to(dtype)
        angles = torch.rand(t, d, generator=gen) * 100
        cos, sin = rope_tables(angles.cos().to(dtype), angles.sin().to(dtype))
        q, k, v = rope_kernel.lm_rope(qkv, cos, sin, hq * d, hkv * d, d)
        assert q.shape == (t, hq, d) and k.shape == v.shape == (t, hkv, d) and q.dtype == dtype
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        want = fused.lm_rope(qkv, cos, sin, hq * d, hkv * d, d)  # float32 math rounded once, as on the GPU
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
        for got, ref in zip((q, k, v), want):
            torch.testing.assert_close(got, ref, **tol)
        qr, kr, vr = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        assert torch.equal(v, vr.reshape(t, hkv, d))
        if dtype == torch.float32:  # the eager rotary rounds after each op: equal in float32 only
            torch.testing.assert_close(q, apply_rope(qr.view(t, hq, d), cos, sin), **tol)
            torch.testing.assert_close(k, apply_rope(kr.view(t, hkv, d), cos, sin), **tol)
assert rope_kernel.lm_rope(torch.zeros(0, 6 * 16), torch.zeros(0, 1, 16), torch.zeros(0, 1, 16), 64, 16, 16)[0].shape == (0, 4, 16)
assert rope_kernel.probe(torch.device("cpu"), torch.float16) and not rope_kernel.SWITCH.broken
print("ok")
"""


def test_kernel_matches_the_rotary_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted("-c", CHECK)


def test_wanted_only_on_cuda_for_power_of_two_heads() -> None:
    from workers.engine import rope_kernel

    assert not rope_kernel.wanted(torch.zeros(2, 64), 16)  # the CPU keeps the eager rotary (exactness tests)
    if torch.cuda.is_available() and rope_kernel.available():
        assert rope_kernel.wanted(torch.zeros(2, 64, device="cuda"), 128)
        assert not rope_kernel.wanted(torch.zeros(2, 64, device="cuda"), 80)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU runs it through the interpreter)")
def test_kernel_matches_the_compiled_rotary_on_cuda() -> None:
    from workers.engine import fused, rope_kernel
    from workers.engine.models.qwen2_5_vl.lm import rope_tables

    assert rope_kernel.probe(torch.device("cuda"), torch.bfloat16), rope_kernel.SWITCH.why_off()
    t, hq, hkv, d = 4096, 28, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", generator=gen, dtype=torch.bfloat16)
    angles = torch.rand(t, d, device="cuda", generator=gen) * 1000
    cos, sin = rope_tables(angles.cos().bfloat16(), angles.sin().bfloat16())
    got = rope_kernel.lm_rope(qkv, cos, sin, hq * d, hkv * d, d)
    want = fused.compiled(fused.lm_rope)(qkv, cos, sin, hq * d, hkv * d, d)
    for g, w in zip(got, want, strict=True):
        diff = (g.float() - w.float()).abs()
        # the same float32 math rounded once; at most a last-bit difference where a contraction differs
        assert float((diff > 0).float().mean()) < 1e-3 and float(diff.max()) <= 2 ** -6 * float(w.abs().max())
