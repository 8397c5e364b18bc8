"""The LM's rotary embedding on the fused q|k|v projection, one Triton program per token: the CUDA path of
``fused.lm_rope``.

Per token the qkv GEMM writes [q | k | v] (28 + 4 + 4 heads of 128 for a 7B); attention wants q and k rotated and
all three as contiguous [T, H, D]. Inductor's kernels for ``fused.lm_rope`` took 62.6 us per 4,096-token prefill
step and layer (H200, profile of one 8 x 1080p request), ~4x the 15 us it takes to read qkv once and write it once:
they were 21 ms of that request's GPU time. Here each program reads its token's row once (the swapped halves come
from the same lines, in cache), rotates in float32 and rounds once, as ``fused.lm_rope`` does, and writes q, k and v.

With ``qk_norm`` it is also Qwen3's per-head RMSNorm of q and k before the rotation (``qwen3_qk_norm_rope``), so both
families' decoders take it.

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
from workers.engine.kernels.triton_switch import TritonSwitch

SWITCH = TritonSwitch("GLIMPSE_TRITON_ROPE")
available = SWITCH.on


def wanted(qkv: Tensor, head_dim: int) -> bool:
    return qkv.is_cuda and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and available()


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


def lm_rope(
    qkv: Tensor,
    cos: Tensor,
    sin_signed: Tensor,
    q_size: int,
    kv_size: int,
    head_dim: int,
    qk_norm: tuple[Tensor, Tensor, float] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``fused.lm_rope``: [T, q + 2kv] -> rotated q [T, Hq, D], rotated k and v [T, Hkv, D], contiguous; cos and
    sin_signed [T, 1, D] with rotate_half's sign folded into sin. ``qk_norm`` (q weight, k weight, eps [D]): an RMSNorm
    over each head before the rotation, as Qwen3's ``qwen3_qk_norm_rope`` does."""
    t = qkv.shape[0]
    hq, hkv = q_size // head_dim, kv_size // head_dim
    q = qkv.new_empty((t, hq, head_dim))
    k, v = qkv.new_empty((t, hkv, head_dim)), qkv.new_empty((t, hkv, head_dim))
    if t == 0:
        return q, k, v
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cos, sin_signed = cos.reshape(t, head_dim).contiguous(), sin_signed.reshape(t, head_dim).contiguous()
    q_w, k_w, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)  # without NORM: D readable values, unused
    _kernel()[(t,)](
        qkv, cos, sin_signed, q, k, v, q_w, k_w, eps, qkv.stride(0), head_dim,
        HQ=hq, HKV=hkv, D=head_dim, BLOCK_HQ=1 << (hq - 1).bit_length(), BLOCK_HKV=1 << (hkv - 1).bit_length(),
        NORM=qk_norm is not None, num_warps=4, **pdl.launch(qkv.device),
    )  # fmt: skip
    return q, k, v


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once against the eager math (7 query and 3 KV heads of 64); a Triton that cannot compile here or
    a wrong answer turns it off for the process (the compiled ``fused.lm_rope`` serves instead)."""
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv, d = 5, 7, 3, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(device=device, dtype=dtype)
    angles = torch.rand(t, d, generator=gen) * 20
    cos, sin = angles.cos()[:, None].to(device=device, dtype=dtype), angles.sin()[:, None].to(device=device, dtype=dtype)

    def check() -> bool:
        q, k, v = lm_rope(qkv, cos, sin, hq * d, hkv * d, d)
        x = qkv.float().view(t, hq + 2 * hkv, d)
        want = x * cos.float() + x.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin.float()
        return (
            torch.allclose(q.float(), want[:, :hq], rtol=2e-2, atol=2e-2)
            and torch.allclose(k.float(), want[:, hq : hq + hkv], rtol=2e-2, atol=2e-2)
            and torch.equal(v, qkv.view(t, -1, d)[:, hq + hkv :])
        )

    return SWITCH.probe(check)
