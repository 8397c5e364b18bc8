"""Qwen3.5's elementwise passes between its GEMMs as hand-written Triton kernels: the CUDA path of the four
torch.compile'd sites its language model had (``fused.qk_norm_partial_rope``, ``fused.gated_output``,
``fused.gated_rms_norm``, ``fused.delta_gates``).

Why: with the ViT's sites gone (vit_kernels.py), these were all that kept Dynamo and Inductor in a hybrid model's
start-up, where an empty Inductor cache cost minutes (the 27B shape's start on an H200: 70-98 s of Inductor,
docs/benchmarks.md "The 27B dense shape"). As Triton kernels they are compiled (or loaded from Triton's cache) by
their start-up probe on the probe threads (runner/kernel_probes.py), and the compiled versions stay the fallback
(``GLIMPSE_TRITON_HYBRID=0``, or a probe that fails).

Each kernel does the compiled site's float32 math in registers and rounds once where the site rounds once (the gated
norm also rounds where its eager module casts explicitly, as Inductor keeps explicit casts), so the results equal the
compiled sites' up to a last bit where a contraction or a reduction order differs. Token counts are the grid and
never an argument (nothing compiles a new variant inside a CUDA-graph capture); head counts and widths are
compile-time constants per model.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels.launch_helpers import pow2
from workers.engine.kernels.triton_switch import TritonSwitch

SWITCH = TritonSwitch("GLIMPSE_TRITON_HYBRID")
available = SWITCH.on  # the kernels run on CUDA tensors, or anywhere under TRITON_INTERPRET=1


def wanted(x: Tensor) -> bool:
    """Whether a call on ``x`` takes these kernels: on CUDA (the CPU keeps the eager math of the exactness tests)
    while the switch is on."""
    return x.is_cuda and available()


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope_kernel(
        q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out, k_out, q_tok, q_head, k_tok, k_head, cs_tok, eps,
        HQ: tl.constexpr, D: tl.constexpr, R: tl.constexpr, DP: tl.constexpr,
    ):  # fmt: skip
        # one program per token and head (q's heads, then k's): RMSNorm over the head, times its weight, then rotary
        # on the first R dims with rotate_half's sign folded into sin
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, DP)
        mask = d < D
        half = R // 2
        swapped = tl.where(d < half, d + half, d - half)
        rotated = d < R
        if h < HQ:
            src, w_ptr = q_ptr + t * q_tok + h * q_head, qw_ptr
            dst = q_out + (t * HQ + h) * D
        else:
            src, w_ptr = k_ptr + t * k_tok + (h - HQ) * k_head, kw_ptr
            dst = k_out + (t * (tl.num_programs(1) - HQ) + h - HQ) * D
        x = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
        xs = tl.load(src + swapped, mask=rotated, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        x = x * r * tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        xs = xs * r * tl.load(w_ptr + swapped, mask=rotated, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * cs_tok + d, mask=rotated, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t * cs_tok + d, mask=rotated, other=0.0).to(tl.float32)
        out = tl.where(rotated, x * c + xs * s, x)
        tl.store(dst + d, out.to(q_out.dtype.element_ty), mask=mask)

    @triton.jit
    def gated_output_kernel(o_ptr, g_ptr, out_ptr, o_tok, o_head, g_tok, g_head, H: tl.constexpr, D: tl.constexpr,
                            HB: tl.constexpr, DP: tl.constexpr):
        # one program per token and HB heads: out[t, h*D + d] = o[t, h, d] * sigmoid(gate[t, h, d])
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HB + tl.arange(0, HB)[:, None]
        d = tl.arange(0, DP)[None, :]
        mask = (h < H) & (d < D)
        o = tl.load(o_ptr + t * o_tok + h * o_head + d, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * g_tok + h * g_head + d, mask=mask, other=0.0).to(tl.float32)
        # the sigmoid rounded to the gate's dtype first, as eager's torch.sigmoid(gate) is (bf16 token-exactness)
        sig = (1.0 / (1.0 + tl.exp(-g))).to(g_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + (t * H + h) * D + d, (o * sig).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gated_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, x_tok, x_head, g_tok, g_head, eps, H: tl.constexpr,
                          D: tl.constexpr, HB: tl.constexpr, DP: tl.constexpr, ROUND_W: tl.constexpr):
        # one program per token and HB value heads, a norm per head: rounded to the activations' dtype (the eager
        # module's cast), times the weight (rounded again where the weight is in that dtype: eager multiplies two
        # bf16 tensors there), then times SiLU(gate) in float32 and rounded once more
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HB + tl.arange(0, HB)[:, None]
        d = tl.arange(0, DP)[None, :]
        mask = (h < H) & (d < D)
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + t * x_tok + h * x_head + d, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * g_tok + h * g_head + d, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        normed = (x * r).to(dtype).to(tl.float32)
        scaled = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32) * normed
        if ROUND_W:
            scaled = scaled.to(dtype).to(tl.float32)
        out = scaled * (g / (1.0 + tl.exp(-g)))
        tl.store(out_ptr + (t * H + h) * D + d, out.to(dtype), mask=mask)

    @triton.jit
    def delta_gates_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_out, beta_out, a_tok, b_tok, H: tl.constexpr,
                           HP: tl.constexpr):
        # one program per token: g = -exp(A_log) * softplus(a + dt_bias) (float32), beta = sigmoid(b)
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, HP)
        mask = h < H
        x = tl.load(a_ptr + t * a_tok + h, mask=mask, other=0.0).to(tl.float32)
        x += tl.load(dtb_ptr + h, mask=mask, other=0.0).to(tl.float32)
        e = tl.exp(tl.minimum(x, 20.0))
        # softplus with torch's threshold of 20; log1p's accuracy where exp(x) is tiny (a decay of nearly 1)
        soft = tl.where(x > 20.0, x, tl.where(e < 1e-4, e * (1.0 - 0.5 * e), tl.log(1.0 + e)))
        g = -tl.exp(tl.load(alog_ptr + h, mask=mask, other=0.0).to(tl.float32)) * soft
        tl.store(g_out + t * H + h, g, mask=mask)
        b = tl.load(b_ptr + t * b_tok + h, mask=mask, other=0.0).to(tl.float32)
        tl.store(beta_out + t * H + h, (1.0 / (1.0 + tl.exp(-b))).to(beta_out.dtype.element_ty), mask=mask)

    return {"qk_norm_rope": qk_norm_rope_kernel, "gated_output": gated_output_kernel,
            "gated_norm": gated_norm_kernel, "delta_gates": delta_gates_kernel}


def _warps(width: int) -> int:
    return 1 if width <= 128 else 2 if width <= 512 else 4


# Elements a program of the per-head passes holds: several heads of a token each (Qwen3.5's value heads are 128
# wide, so 16 a program), rather than one ~256-byte head per program and 32-48 programs a token.
HEAD_BLOCK_ELEMENTS = 2048


def _head_block(heads: int, width: int) -> int:
    return min(pow2(heads), max(1, HEAD_BLOCK_ELEMENTS // pow2(width)))


def _unit_inner(x: Tensor) -> Tensor:
    """``x`` as the kernels read it: any outer strides, the innermost dimension contiguous (copied where it is not,
    which no caller hands today)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def qk_norm_partial_rope(
    q: Tensor, k: Tensor, q_w: Tensor, k_w: Tensor, eps: float, cos: Tensor, sin: Tensor, rotary_dim: int
) -> tuple[Tensor, Tensor]:
    """``fused.qk_norm_partial_rope``: q [T, Hq, D] and k [T, Hkv, D] (heads and tokens at any stride) -> normed
    and rotated on the first ``rotary_dim`` dims, both contiguous; cos and sign-folded sin [T, 1, rotary_dim]."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    q, k, cos, sin = _unit_inner(q), _unit_inner(k), _unit_inner(cos), _unit_inner(sin)
    if cos.stride(0) != sin.stride(0) or rotary_dim % 2 or rotary_dim > d:
        raise ValueError(f"qk_norm_partial_rope: cos/sin {tuple(cos.shape)}, rotary_dim {rotary_dim}, head_dim {d}")
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t:
        _kernels()["qk_norm_rope"][(t, hq + hkv)](
            q, k, q_w, k_w, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            eps, HQ=hq, D=d, R=rotary_dim, DP=pow2(d), num_warps=_warps(d),
        )  # fmt: skip
    return q_out, k_out


def gated_output(out: Tensor, gate: Tensor) -> Tensor:
    """``fused.gated_output``: the attention output [T, H, D] times sigmoid(gate) ([T, H, D] at any stride)
    -> [T, H*D] contiguous."""
    t, h, d = gate.shape
    out, gate = _unit_inner(out.view(t, h, d)), _unit_inner(gate)  # out may come as [T, H*D] rows
    result = torch.empty((t, h * d), dtype=out.dtype, device=out.device)
    if t:
        hb = _head_block(h, d)
        _kernels()["gated_output"][(t, -(-h // hb))](out, gate, result, out.stride(0), out.stride(1), gate.stride(0),
                                                     gate.stride(1), H=h, D=d, HB=hb, DP=pow2(d),
                                                     num_warps=_warps(hb * d))
    return result


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``fused.gated_rms_norm``: x and gate [T, H, D] (at any stride) -> [T, H, D] contiguous in x's dtype."""
    t, h, d = x.shape
    x, gate = _unit_inner(x), _unit_inner(gate)
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        hb = _head_block(h, d)
        _kernels()["gated_norm"][(t, -(-h // hb))](x, gate, weight, out, x.stride(0), x.stride(1), gate.stride(0),
                                                   gate.stride(1), eps, H=h, D=d, HB=hb, DP=pow2(d),
                                                   ROUND_W=weight.dtype == x.dtype, num_warps=_warps(hb * d))
    return out


def delta_gates(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """``fused.delta_gates``: a and b [T, H] (rows at any stride) -> the decay g float32 [T, H] and beta [T, H] in
    b's dtype, both contiguous."""
    t, h = a.shape
    a, b = _unit_inner(a), _unit_inner(b)
    g = torch.empty((t, h), dtype=torch.float32, device=a.device)
    beta = torch.empty((t, h), dtype=b.dtype, device=b.device)
    if t:
        _kernels()["delta_gates"][(t,)](a, b, a_log, dt_bias, g, beta, a.stride(0), b.stride(0), H=h, HP=pow2(h),
                                        num_warps=1)
    return g, beta


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """The four kernels once against the compiled sites' eager definitions, at small shapes off powers of two (the
    27B's 48 value heads, a partial rotary); a Triton that cannot compile here or a wrong answer turns them off."""
    from workers.engine.kernels import fused

    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)

    t, hq, hkv, d, r = 3, 3, 1, 48, 16
    qkv = rand(t, (2 * hq + 2 * hkv) * d)
    q_gate = qkv[:, : 2 * hq * d].view(t, hq, 2 * d)
    q, gate = q_gate[..., :d], q_gate[..., d:]
    k = qkv[:, 2 * hq * d : (2 * hq + hkv) * d].view(t, hkv, d)
    q_w, k_w, cos, sin = rand(d, scale=0.5) + 1, rand(d, scale=0.5) + 1, rand(t, 1, r), rand(t, 1, r)
    attn = rand(t, hq, d)
    proj = rand(t, 2 * 5 * 8 + 2 * 48)  # x | z | a | b, as the in-projection's columns
    x, z = proj[:, : 5 * 8].view(t, 5, 8), proj[:, 5 * 8 : 10 * 8].view(t, 5, 8)
    a, b = proj[:, 80:128], proj[:, 128:176]
    a_log, dt_bias = torch.rand(48, generator=gen).to(device), torch.randn(48, generator=gen).to(device)
    norm_w = rand(8, scale=0.5) + 1

    def check() -> bool:
        pairs = [
            *zip(qk_norm_partial_rope(q, k, q_w, k_w, 1e-6, cos, sin, r),
                 fused.qk_norm_partial_rope(q, k, q_w, k_w, 1e-6, cos, sin, r)),
            (gated_output(attn, gate), fused.gated_output(attn, gate)),
            (gated_rms_norm(x, z, norm_w, 1e-6), fused.gated_rms_norm(x, z, norm_w, 1e-6)),
            *zip(delta_gates(a, b, a_log, dt_bias), fused.delta_gates(a, b, a_log, dt_bias)),
        ]  # fmt: skip
        return all(g.shape == w.shape and g.dtype == w.dtype and torch.allclose(g.float(), w.float(), rtol=2e-2,
                                                                                 atol=2e-2) for g, w in pairs)

    return SWITCH.probe(check)

