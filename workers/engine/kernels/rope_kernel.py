"""The LM's rotary embedding on the fused q|k|v projection, one Triton program per token: the CUDA path of
``fused.lm_rope``.

Per token the qkv GEMM writes [q | k | v] (28 + 4 + 4 heads of 128 for a 7B); attention wants q and k rotated and
all three as contiguous [T, H, D]. Inductor's kernels for ``fused.lm_rope`` took 62.6 us per 4,096-token prefill
step and layer (H200, profile of one 8 x 1080p request), ~4x the 15 us it takes to read qkv once and write it once:
they were 21 ms of that request's GPU time. Here each program reads its token's row once (the swapped halves come
from the same lines, in cache), rotates in float32 and rounds once, as ``fused.lm_rope`` does, and writes q, k and v.

With ``qk_norm`` it is also Qwen3's per-head RMSNorm of q and k before the rotation (``qwen3_qk_norm_rope``), so both
families' decoders take it.

A decode step's qkv GEMM may split K (block-FP8's always does: w8a16_gemm.py splits Qwen3-VL-8B's in 8) and hand over
float32 partials (skinny_gemm.Partials) rather than run a sum pass, one kernel and launch more per layer. Those go to
a second kernel with one program per token and head: its [split, D] partials come in one load and are summed,
rounded to the activations' dtype as the sum pass rounds (the order of the sum is the kernel's own, so the last bit
of a sum may differ from the sum pass's), then normed and rotated as above; a KV head's program also writes its v.
One program per token would stream all of a token's partials alone (8 splits of a 6,144-wide row: 196 KB).

The per-head kernel can also put a KV head's rotated k and its v into their paged-cache slot (``cache_slots``), so the
attention backend skips its K/V write (``AttentionMetadata.kv_written``): one kernel and launch less per layer of a
decode step (Qwen3-VL-8B: 36 of them, 0.048 ms of a batch-1 step on an H200). Only where the cache holds the
activations' dtype (an FP8 cache is quantized by kv_write_kernel.py) and the backend honours ``kv_written`` (not the
piecewise-graph splitter, whose captured slots are its own).

The token count is the grid, so no token count compiles a new variant (CUDA-graph captures included); head counts and
head_dim are compile-time constants per model. head_dim must be a power of two (every Qwen2.5-VL and Qwen3-VL size
has 128).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels import fused, pdl
from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.kernels.skinny_gemm import Partials
from workers.engine.kernels.triton_switch import TritonSwitch

SWITCH = TritonSwitch("GLIMPSE_TRITON_ROPE")
available = SWITCH.on
# Rows up to which a plain qkv takes the per-head kernel (one program per token and head) rather than the per-token
# one (one program per token): a decode step's few tokens spread over more of the card. Qwen3-VL-8B's heads with the
# norms, H200, `python -m benchmarks.kernels.rope_bench --decode-rows 1,4,16`: 1.06-1.23 us a call against 1.89-1.92.
HEADS_MAX_ROWS = 16


def wanted(qkv: Tensor | Partials, head_dim: int) -> bool:
    on_cuda = (qkv.parts if isinstance(qkv, Partials) else qkv).is_cuda
    return on_cuda and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and available()


def per_head(qkv: Tensor | Partials, by_head: bool | None = None) -> bool:
    """Whether ``lm_rope`` takes the per-head kernel: always for partials, else ``by_head`` or up to HEADS_MAX_ROWS."""
    if isinstance(qkv, Partials):
        return True
    return by_head if by_head is not None else qkv.shape[0] <= HEADS_MAX_ROWS


def cache_slots(
    qkv: Tensor | Partials, head_dim: int, kv_cache: Tensor, meta: AttentionMetadata, backend: AttentionBackend
) -> Tensor | None:
    """``meta.slot_mapping`` where a layer's rotary should write its K/V into ``kv_cache`` itself (the per-head kernel
    will run, the cache is plain and the backend skips its own write given ``kv_written``), else None."""
    if meta.kv_written or not backend.honours_kv_written or not fused.worth_it(qkv) or not wanted(qkv, head_dim):
        return None
    plain_cache = kv_cache.dtype == qkv.dtype and kv_cache.is_contiguous() and kv_cache.shape[-1] == head_dim
    return meta.slot_mapping if plain_cache and per_head(qkv) else None


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def lm_rope_kernel(
        qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, eps, qkv_row, table_row,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
        NORM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # pdl.py: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, D)[None, :]
        swapped = (d + D // 2) % D  # rotate_half's source column; its sign is folded into sin
        c = tl.load(cos_ptr + t * table_row + d).to(tl.float32)
        s = tl.load(sin_ptr + t * table_row + d).to(tl.float32)
        # the norms' weights, at each column and at its swapped one (without NORM: read, never used)
        qw = tl.load(qw_ptr + d).to(tl.float32)
        qws = tl.load(qw_ptr + swapped).to(tl.float32)
        kw = tl.load(kw_ptr + d).to(tl.float32)
        kws = tl.load(kw_ptr + swapped).to(tl.float32)
        src = qkv_ptr + t * qkv_row
        hq = tl.arange(0, BLOCK_HQ)[:, None]
        ok = hq < HQ
        x = tl.load(src + hq * D + d, mask=ok, other=0.0).to(tl.float32)
        xs = tl.load(src + hq * D + swapped, mask=ok, other=0.0).to(tl.float32)
        if NORM:  # Qwen3: RMSNorm over each head first; a row's factor serves both of its halves
            r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            x = x * r * qw
            xs = xs * r * qws
        out = x * c + xs * s
        tl.store(q_ptr + t * (HQ * D) + hq * D + d, out.to(q_ptr.dtype.element_ty), mask=ok)
        hk = tl.arange(0, BLOCK_HKV)[:, None]
        ok = hk < HKV
        src = src + HQ * D
        x = tl.load(src + hk * D + d, mask=ok, other=0.0).to(tl.float32)
        xs = tl.load(src + hk * D + swapped, mask=ok, other=0.0).to(tl.float32)
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            x = x * r * kw
            xs = xs * r * kws
        out = x * c + xs * s
        tl.store(k_ptr + t * (HKV * D) + hk * D + d, out.to(k_ptr.dtype.element_ty), mask=ok)
        v = tl.load(src + HKV * D + hk * D + d, mask=ok)
        tl.store(v_ptr + t * (HKV * D) + hk * D + d, v, mask=ok)

    return lm_rope_kernel


@functools.cache
def _heads_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["plane", "cache_plane"])
    def lm_rope_heads_kernel(
        src_ptr, bias_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cache_ptr, slot_ptr, eps, src_row,
        plane, table_row, cache_plane,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
        NORM: tl.constexpr, CACHE: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # pdl.py: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)  # a query head, or from HQ on a KV head: its k rotated and its v copied
        d = tl.arange(0, D)
        swapped = (d + D // 2) % D  # rotate_half's source column; its sign is folded into sin
        dtype = q_ptr.dtype.element_ty
        # q and k heads sit at h * D of the row either way (k follows q); v head h - HQ at HKV * D further
        head = src_ptr + t * src_row + h * D
        if SPLIT == 0:
            x = tl.load(head + d).to(tl.float32)
            xs = tl.load(head + swapped).to(tl.float32)
        else:  # float32 partials [SPLIT, rows, n]: all splits in one load, summed, rounded as the sum pass rounds
            g = tl.arange(0, SPLIT)[:, None] * plane
            x = tl.sum(tl.load(head + g + d[None, :]), axis=0)
            xs = tl.sum(tl.load(head + g + swapped[None, :]), axis=0)
            if HAS_BIAS:
                x += tl.load(bias_ptr + h * D + d).to(tl.float32)
                xs += tl.load(bias_ptr + h * D + swapped).to(tl.float32)
            x = x.to(dtype).to(tl.float32)
            xs = xs.to(dtype).to(tl.float32)
        c = tl.load(cos_ptr + t * table_row + d).to(tl.float32)
        s = tl.load(sin_ptr + t * table_row + d).to(tl.float32)
        if h < HQ:
            w_ptr = qw_ptr
            dst = q_ptr + (t * HQ + h) * D
        else:
            w_ptr = kw_ptr
            dst = k_ptr + (t * HKV + h - HQ) * D
        if NORM:  # Qwen3: RMSNorm over the head first; one factor serves both halves
            r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            x = x * r * tl.load(w_ptr + d).to(tl.float32)
            xs = xs * r * tl.load(w_ptr + swapped).to(tl.float32)
        out = (x * c + xs * s).to(dtype)
        tl.store(dst + d, out)
        if h >= HQ:
            v_head = head + HKV * D
            if SPLIT == 0:
                v = tl.load(v_head + d)
            else:
                v = tl.sum(tl.load(v_head + g + d[None, :]), axis=0)
                if HAS_BIAS:
                    v += tl.load(bias_ptr + (h + HKV) * D + d).to(tl.float32)
            v = v.to(dtype)
            tl.store(v_ptr + (t * HKV + h - HQ) * D + d, v)
            if CACHE:  # the token's slot in the paged cache ([2, slots, HKV, D]): k, and v a plane further
                slot = tl.load(slot_ptr + t).to(tl.int64)
                at = cache_ptr + (slot * HKV + h - HQ) * D + d
                tl.store(at, out)
                tl.store(at + cache_plane, v)

    return lm_rope_heads_kernel


def lm_rope(
    qkv: Tensor | Partials,
    cos: Tensor,
    sin_signed: Tensor,
    q_size: int,
    kv_size: int,
    head_dim: int,
    qk_norm: tuple[Tensor, Tensor, float] | None = None,
    by_head: bool | None = None,
    cache: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``fused.lm_rope``: [T, q + 2kv] -> rotated q [T, Hq, D], rotated k and v [T, Hkv, D], contiguous; cos and
    sin_signed [T, 1, D] with rotate_half's sign folded into sin. ``qk_norm`` (q weight, k weight, eps [D]): an RMSNorm
    over each head before the rotation, as Qwen3's ``qwen3_qk_norm_rope`` does.

    qkv may be a split-K decode product's partials (skinny_gemm.Partials): the per-head kernel sums them. ``by_head``
    picks the kernel for a plain qkv (default: per head up to HEADS_MAX_ROWS rows). ``cache`` (kv_cache, slot_mapping;
    per-head kernel only, ``cache_slots``): k and v also go into their slots of the paged cache."""
    if isinstance(qkv, Partials) and qkv.parts.shape[0] & (qkv.parts.shape[0] - 1):
        qkv = qkv.settle()  # the per-head kernel loads every split at once, a power-of-two count of them
    src = qkv.parts if isinstance(qkv, Partials) else qkv
    t = src.shape[-2]
    hq, hkv = q_size // head_dim, kv_size // head_dim
    dtype = qkv.dtype
    q = torch.empty((t, hq, head_dim), dtype=dtype, device=src.device)
    k, v = torch.empty_like(q[:, :hkv]), torch.empty_like(q[:, :hkv])
    if t == 0:
        return q, k, v
    if src.stride(-1) != 1:
        src = src.contiguous()
    cos, sin_signed = cos.reshape(t, head_dim).contiguous(), sin_signed.reshape(t, head_dim).contiguous()
    q_w, k_w, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)  # without NORM: D readable values, unused
    if per_head(qkv, by_head):
        split, bias = (src.shape[0], qkv.bias) if isinstance(qkv, Partials) else (0, None)
        kv_cache, slots = cache if cache is not None else (q, q)  # without CACHE: never touched
        _heads_kernel()[(t, hq + hkv)](
            src, bias if bias is not None else src, cos, sin_signed, q, k, v, q_w, k_w, kv_cache, slots, eps,
            src.stride(-2), src.stride(0) if split else 0, head_dim, kv_cache[0].numel() if cache is not None else 0,
            HQ=hq, HKV=hkv, D=head_dim, SPLIT=split, HAS_BIAS=bias is not None, NORM=qk_norm is not None,
            CACHE=cache is not None, num_warps=2 if split else 1, **pdl.launch(q.device),
        )  # fmt: skip
        return q, k, v
    if cache is not None:
        raise ValueError("lm_rope writes the KV cache from the per-head kernel only (rope_kernel.cache_slots)")
    _kernel()[(t,)](
        src, cos, sin_signed, q, k, v, q_w, k_w, eps, src.stride(0), head_dim,
        HQ=hq, HKV=hkv, D=head_dim, BLOCK_HQ=1 << (hq - 1).bit_length(), BLOCK_HKV=1 << (hkv - 1).bit_length(),
        NORM=qk_norm is not None, num_warps=4, **pdl.launch(q.device),
    )  # fmt: skip
    return q, k, v


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run both kernels once against the eager math (7 query and 3 KV heads of 64; the per-head one also on two
    partials, and into a paged cache); a Triton that cannot compile here or a wrong answer turns them off for the
    process (the compiled ``fused.lm_rope`` serves instead)."""
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv, d = 5, 7, 3, 64
    halves = torch.randn(2, t, (hq + 2 * hkv) * d, generator=gen).to(device=device)
    qkv = halves.sum(0).to(dtype)
    angles = torch.rand(t, d, generator=gen) * 20
    cos, sin = angles.cos()[:, None].to(device=device, dtype=dtype), angles.sin()[:, None].to(device=device, dtype=dtype)
    slots = torch.tensor([7, 0, 12, 3, 9], dtype=torch.int64, device=device)

    def check() -> bool:
        x = qkv.float().view(t, hq + 2 * hkv, d)
        want = x * cos.float() + x.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin.float()
        kv_cache = torch.zeros(2, 4, 4, hkv, d, dtype=dtype, device=device)
        for given, by_head, cache in ((qkv, False, None), (qkv, True, (kv_cache, slots)), (Partials(halves, None, dtype), None, None)):
            q, k, v = lm_rope(given, cos, sin, hq * d, hkv * d, d, by_head=by_head, cache=cache)
            if not (
                torch.allclose(q.float(), want[:, :hq], rtol=2e-2, atol=2e-2)
                and torch.allclose(k.float(), want[:, hq : hq + hkv], rtol=2e-2, atol=2e-2)
                and torch.allclose(v.float(), x[:, hq + hkv :], rtol=2e-2, atol=2e-2)
            ):
                return False
            if cache is not None:
                flat = kv_cache.view(2, -1, hkv, d)
                if not (torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)):
                    return False
        return True

    return SWITCH.probe(check)
