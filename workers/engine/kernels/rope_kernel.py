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

The token count is the grid, so no token count compiles a new variant (CUDA-graph captures included); head counts and
head_dim are compile-time constants per model. head_dim must be a power of two (every Qwen2.5-VL and Qwen3-VL size
has 128).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels import pdl
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

    @triton.jit(do_not_specialize=["plane"])
    def lm_rope_heads_kernel(
        src_ptr, bias_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, eps, src_row, plane, table_row,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
        NORM: tl.constexpr, PDL: tl.constexpr,
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
        tl.store(dst + d, (x * c + xs * s).to(dtype))
        if h >= HQ:
            v_head = head + HKV * D
            if SPLIT == 0:
                v = tl.load(v_head + d)
            else:
                v = tl.sum(tl.load(v_head + g + d[None, :]), axis=0)
                if HAS_BIAS:
                    v += tl.load(bias_ptr + (h + HKV) * D + d).to(tl.float32)
            tl.store(v_ptr + (t * HKV + h - HQ) * D + d, v.to(dtype))

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
) -> tuple[Tensor, Tensor, Tensor]:
    """``fused.lm_rope``: [T, q + 2kv] -> rotated q [T, Hq, D], rotated k and v [T, Hkv, D], contiguous; cos and
    sin_signed [T, 1, D] with rotate_half's sign folded into sin. ``qk_norm`` (q weight, k weight, eps [D]): an RMSNorm
    over each head before the rotation, as Qwen3's ``qwen3_qk_norm_rope`` does.

    qkv may be a split-K decode product's partials (skinny_gemm.Partials): the per-head kernel sums them. ``by_head``
    picks the kernel for a plain qkv (default: per head up to HEADS_MAX_ROWS rows)."""
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
    if isinstance(qkv, Partials) or (by_head if by_head is not None else t <= HEADS_MAX_ROWS):
        split, bias = (src.shape[0], qkv.bias) if isinstance(qkv, Partials) else (0, None)
        _heads_kernel()[(t, hq + hkv)](
            src, bias if bias is not None else src, cos, sin_signed, q, k, v, q_w, k_w, eps, src.stride(-2),
            src.stride(0) if split else 0, head_dim, HQ=hq, HKV=hkv, D=head_dim, SPLIT=split,
            HAS_BIAS=bias is not None, NORM=qk_norm is not None, num_warps=2 if split else 1, **pdl.launch(q.device),
        )  # fmt: skip
        return q, k, v
    _kernel()[(t,)](
        src, cos, sin_signed, q, k, v, q_w, k_w, eps, src.stride(0), head_dim,
        HQ=hq, HKV=hkv, D=head_dim, BLOCK_HQ=1 << (hq - 1).bit_length(), BLOCK_HKV=1 << (hkv - 1).bit_length(),
        NORM=qk_norm is not None, num_warps=4, **pdl.launch(q.device),
    )  # fmt: skip
    return q, k, v


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run both kernels once against the eager math (7 query and 3 KV heads of 64; the per-head one also on two
    partials); a Triton that cannot compile here or a wrong answer turns them off for the process (the compiled
    ``fused.lm_rope`` serves instead)."""
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv, d = 5, 7, 3, 64
    halves = torch.randn(2, t, (hq + 2 * hkv) * d, generator=gen).to(device=device)
    qkv = halves.sum(0).to(dtype)
    angles = torch.rand(t, d, generator=gen) * 20
    cos, sin = angles.cos()[:, None].to(device=device, dtype=dtype), angles.sin()[:, None].to(device=device, dtype=dtype)

    def check() -> bool:
        x = qkv.float().view(t, hq + 2 * hkv, d)
        want = x * cos.float() + x.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin.float()
        for given, by_head in ((qkv, False), (qkv, True), (Partials(halves, None, dtype), None)):
            q, k, v = lm_rope(given, cos, sin, hq * d, hkv * d, d, by_head=by_head)
            if not (
                torch.allclose(q.float(), want[:, :hq], rtol=2e-2, atol=2e-2)
                and torch.allclose(k.float(), want[:, hq : hq + hkv], rtol=2e-2, atol=2e-2)
                and torch.allclose(v.float(), x[:, hq + hkv :], rtol=2e-2, atol=2e-2)
            ):
                return False
        return True

    return SWITCH.probe(check)
