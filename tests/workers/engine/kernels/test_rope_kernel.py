"""The Triton rotary kernel for the LM's fused qkv (the CUDA path of fused.lm_rope and of Qwen3's q/k norm + rotary):
on the CPU through Triton's interpreter against the eager math, and on a GPU against the compiled versions."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.kernels.kernel_check import run_kernel_check

CHECK = """
import torch
from workers.engine.kernels import fused
from workers.engine.kernels import rope_kernel
from workers.engine.kernels.skinny_gemm import Partials
from workers.engine.models.qwen2_5_vl.lm import apply_rope, rope_tables
from workers.engine.models.qwen3_vl.lm import qwen3_qk_norm_rope

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
# Qwen3's per-head RMSNorm of q and k before the rotation: against qwen3_qk_norm_rope (float32 math, rounded once)
for t, hq, hkv, d in ((5, 32, 8, 128), (2, 3, 1, 16)):
    for dtype in (torch.float32, torch.float16):
        qkv = (3 * torch.randn(t, (hq + 2 * hkv) * d, generator=gen)).to(dtype)
        angles = torch.rand(t, d, generator=gen) * 100
        cos, sin = rope_tables(angles.cos().to(dtype), angles.sin().to(dtype))
        q_w, k_w = (torch.rand(d, generator=gen) + 0.5).to(dtype), (torch.rand(d, generator=gen) + 0.5).to(dtype)
        got = rope_kernel.lm_rope(qkv, cos, sin, hq * d, hkv * d, d, (q_w, k_w, 1e-6))
        want = qwen3_qk_norm_rope(qkv, q_w, k_w, 1e-6, cos, sin, (hq * d, hkv * d, d))
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=2e-3)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **tol)
        plain = rope_kernel.lm_rope(qkv, cos, sin, hq * d, hkv * d, d)
        assert not torch.allclose(plain[0].float(), got[0].float(), atol=1e-2)  # the norm did something
# The per-head kernel (decode rows), on a plain qkv and on a split-K product's float32 partials (summed in the kernel,
# in its own order, then rounded as the sum pass rounds), with Qwen3's norms and without, a bias and none.
for t, hq, hkv, d, split, norm, bias in ((1, 32, 8, 128, 8, True, False), (3, 28, 4, 128, 4, False, True),
                                         (2, 3, 1, 16, 2, True, True), (2, 3, 1, 16, 3, False, True),
                                         (64, 3, 1, 16, 2, True, False)):  # 64: FP8's decode batches (W8A16_MAX_ROWS)
    dtype = torch.bfloat16
    n = (hq + 2 * hkv) * d
    parts = torch.randn(split, t, n, generator=gen)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    product = Partials(parts, b, dtype)
    qkv = product.settle()
    angles = torch.rand(t, d, generator=gen) * 100
    cos, sin = rope_tables(angles.cos().to(dtype), angles.sin().to(dtype))
    weights = ((torch.rand(d, generator=gen) + 0.5).to(dtype), (torch.rand(d, generator=gen) + 0.5).to(dtype), 1e-6)
    qk_norm = weights if norm else None
    want = rope_kernel.lm_rope(qkv, cos, sin, hq * d, hkv * d, d, qk_norm, by_head=False)
    for got in (rope_kernel.lm_rope(qkv, cos, sin, hq * d, hkv * d, d, qk_norm, by_head=True),
                rope_kernel.lm_rope(product, cos, sin, hq * d, hkv * d, d, qk_norm)):
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == dtype and g.is_contiguous()
            torch.testing.assert_close(g, w, rtol=2**-7, atol=2e-2)  # a bf16 ulp: the sums' and norms' orders
    plain = rope_kernel.lm_rope(qkv, cos, sin, hq * d, hkv * d, d, qk_norm, by_head=True)
    assert torch.equal(plain[2], qkv.view(t, -1, d)[:, hq + hkv :])  # v: copied
    # into a paged cache [2, blocks, block_size, Hkv, D] as well: k and v at their slots, every other slot untouched
    n_slots = 4 * max(3, t // 2)  # blocks of 4: room for every token and slots left untouched
    kv_cache = torch.full((2, n_slots // 4, 4, hkv, d), 7.0, dtype=dtype)
    slots = torch.randperm(n_slots, generator=gen)[:t]
    for given in (qkv, product):
        kv_cache.fill_(7.0)
        q, k, v = rope_kernel.lm_rope(given, cos, sin, hq * d, hkv * d, d, qk_norm, by_head=True, cache=(kv_cache, slots))
        flat = kv_cache.view(2, -1, hkv, d)
        assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)
        others = torch.ones(n_slots, dtype=torch.bool)
        others[slots] = False
        assert bool((flat[:, others] == 7.0).all())
try:  # the per-token kernel has no cache write
    rope_kernel.lm_rope(qkv, cos, sin, hq * d, hkv * d, d, by_head=False, cache=(kv_cache, slots))
    raise AssertionError("the per-token kernel took a cache")
except ValueError as exc:
    assert "per-head" in str(exc)
assert rope_kernel.lm_rope(torch.zeros(0, 6 * 16), torch.zeros(0, 1, 16), torch.zeros(0, 1, 16), 64, 16, 16)[0].shape == (0, 4, 16)
"""


def test_kernel_matches_the_rotary_under_the_interpreter() -> None:
    run_kernel_check(CHECK, "rope_kernel", "float16")


def test_wanted_only_on_cuda_for_power_of_two_heads() -> None:
    from workers.engine.kernels import rope_kernel

    assert not rope_kernel.wanted(torch.zeros(2, 64), 16)  # the CPU keeps the eager rotary (exactness tests)
    if torch.cuda.is_available() and rope_kernel.available():
        assert rope_kernel.wanted(torch.zeros(2, 64, device="cuda"), 128)
        assert not rope_kernel.wanted(torch.zeros(2, 64, device="cuda"), 80)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU runs it through the interpreter)")
def test_kernel_matches_the_compiled_rotary_on_cuda() -> None:
    from workers.engine.kernels import fused, rope_kernel
    from workers.engine.models.qwen2_5_vl.lm import rope_tables
    from workers.engine.models.qwen3_vl.lm import qwen3_qk_norm_rope

    assert rope_kernel.probe(torch.device("cuda"), torch.bfloat16), rope_kernel.SWITCH.why_off()
    t, hq, hkv, d = 4096, 28, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", generator=gen, dtype=torch.bfloat16)
    angles = torch.rand(t, d, device="cuda", generator=gen) * 1000
    cos, sin = rope_tables(angles.cos().bfloat16(), angles.sin().bfloat16())
    q_w, k_w = (torch.rand(d, device="cuda", generator=gen) + 0.5).bfloat16(), torch.ones(d, device="cuda").bfloat16()
    pairs = [
        (rope_kernel.lm_rope(qkv, cos, sin, hq * d, hkv * d, d),
         fused.compiled(fused.lm_rope)(qkv, cos, sin, hq * d, hkv * d, d)),
        (rope_kernel.lm_rope(qkv, cos, sin, hq * d, hkv * d, d, (q_w, k_w, 1e-6)),
         fused.compiled(qwen3_qk_norm_rope)(qkv, q_w, k_w, 1e-6, cos, sin, (hq * d, hkv * d, d))),
    ]  # fmt: skip
    for got, want in pairs:
        for g, w in zip(got, want, strict=True):
            diff = (g.float() - w.float()).abs()
            # the same float32 math rounded once; last-bit differences where a contraction or the rsqrt differ
            assert float((diff > 0).float().mean()) < 1e-2 and float(diff.max()) <= 2**-6 * float(w.abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_per_head_kernel_sums_decode_partials_on_cuda(rows: int) -> None:
    """Qwen3-VL-8B's heads at decode rows: the per-head kernel on a bf16 qkv and on block-FP8's 8 split-K partials
    against the per-token kernel on the sum pass's output."""
    from workers.engine.kernels import rope_kernel
    from workers.engine.kernels.skinny_gemm import Partials
    from workers.engine.models.qwen2_5_vl.lm import rope_tables

    hq, hkv, d = 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(rows)
    parts = torch.randn(8, rows, (hq + 2 * hkv) * d, device="cuda", generator=gen)
    bias = torch.randn((hq + 2 * hkv) * d, device="cuda", generator=gen).bfloat16()
    product = Partials(parts, bias, torch.bfloat16)
    qkv = product.settle()
    angles = torch.rand(rows, d, device="cuda", generator=gen) * 1000
    cos, sin = rope_tables(angles.cos().bfloat16(), angles.sin().bfloat16())
    norm = ((torch.rand(d, device="cuda", generator=gen) + 0.5).bfloat16(), torch.ones(d, device="cuda").bfloat16(), 1e-6)
    want = rope_kernel.lm_rope(qkv, cos, sin, hq * d, hkv * d, d, norm, by_head=False)
    by_head = rope_kernel.lm_rope(qkv, cos, sin, hq * d, hkv * d, d, norm, by_head=True)
    assert torch.equal(by_head[2], want[2])
    for got in (by_head, rope_kernel.lm_rope(product, cos, sin, hq * d, hkv * d, d, norm)):
        for g, w in zip(got, want, strict=True):
            diff = (g.float() - w.float()).abs()
            # the sums' and norms' orders differ: a last bit here and there
            assert float((diff > 0).float().mean()) < 5e-2 and float(diff.max()) <= 2**-6 * float(w.abs().max())
