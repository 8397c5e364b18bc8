"""An all-decode step of the gated delta rule in one Triton kernel that reads and writes the state pool in place.

A hybrid model's decode step moves each sequence's recurrent state (per linear-attention layer, a [K, V] matrix per
value head: 48 x 128 x 128 in Qwen3.5-27B, 1.5 MiB in bf16) through the step. fla's fused recurrent kernel takes the
states as a dense batch and hands back float32 finals, so the step around it gathered the slots (index_select),
zeroed fresh ones (masked_fill), cast the finals back (to bf16) and scattered them (index_copy): six passes over the
states where the recurrence itself needs one read and one write. At 64 sequences of the 27B shape those passes were
about half of the step (H200, `benchmarks/engine/decode_profile.py --shape qwen3.5-27b --layers 32 --batch 64
--context 2200`: index_copy 4.0 ms, the fill 3.6, the casts 1.9, the gathers 1.7, fla's kernel 2.9 of a 27.3 ms step).

Here each program takes one (sequence, value head, BV-column strip) of the state: it loads the strip from the
sequence's slot (zeros where the sequence has no initial state, without reading the slot: it may hold NaN from an
earlier owner), applies the decay, the delta update and the readout in float32 as fla's kernel does (the l2 norms of
q and k inside, value head j reading key head j // (Hv / Hk)), and stores the strip back into the same slot in the
pool's dtype. Slots and the has-initial flags are read on the device, so the step is CUDA-graph safe.

The CPU keeps gated_delta.py's torch step, which the exactness tests compare with transformers; on CUDA the start-up
probe checks this kernel once against a float32 recurrence (``reference_step``, tied to the torch step by a test), and
a failure leaves fla's kernel (or torch) serving.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels.attention import StateMetadata
from workers.engine.kernels.triton_switch import TritonSwitch

SWITCH = TritonSwitch("GLIMPSE_TRITON_GDN_DECODE")
available = SWITCH.on

# Columns of the state a program owns, and its warps: 64 x 2-byte columns are 128-byte rows per key row, fully
# coalesced, and 128 x 64 float32 of state over 2 warps. Picked on an H200 by the rule's own graphed time
# (`python -m benchmarks.kernels.gated_delta_bench --prefill "" --batch 16,64,128 --heads 16,48 --block-v 8,16,32,64
# --warps 1,2,4,8`): at the 27B's 16/48 heads BV 64 on 2 warps took 0.0134 / 0.0738 / 0.146 ms at 16 / 64 / 128
# sequences against 0.0190 / 0.0899 / 0.179 for BV 32 on 4 (the first choice), and 0.0501 against 0.0582 ms at the
# 35B-A3B's 16/32 heads and 64 sequences; no other setting was faster at more than one of those.
BLOCK_V = 64
NUM_WARPS = 2

_kernel: Any = None


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def gdn_decode_kernel(
        q, k, v, g, beta, o, pool, slots, has_initial,
        sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sg_n, sb_n, so_n, so_h, sp_slot, sp_h, sp_k,
        scale,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
    ):  # fmt: skip
        i_nh = tl.program_id(0)
        i_v = tl.program_id(1)
        n = i_nh // HV
        hv = i_nh % HV
        h = hv // (HV // H)
        slot = tl.load(slots + n).to(tl.int64)
        init = tl.load(has_initial + n) != 0
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        mk = o_k < K
        mv = o_v < V
        b_q = tl.load(q + n * sq_n + h * sq_h + o_k, mask=mk, other=0).to(tl.float32)
        b_k = tl.load(k + n * sk_n + h * sk_h + o_k, mask=mk, other=0).to(tl.float32)
        b_v = tl.load(v + n * sv_n + hv * sv_h + o_v, mask=mv, other=0).to(tl.float32)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale
        b_g = tl.load(g + n * sg_n + hv).to(tl.float32)
        b_beta = tl.load(beta + n * sb_n + hv).to(tl.float32)
        p_h = pool + slot * sp_slot + hv * sp_h + o_k[:, None] * sp_k + o_v[None, :]
        mh = mk[:, None] & mv[None, :]
        b_h = tl.load(p_h, mask=mh & init, other=0).to(tl.float32)
        b_h *= tl.exp(b_g)
        b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(o + n * so_n + hv * so_h + o_v, b_o.to(o.dtype.element_ty), mask=mv)
        tl.store(p_h, b_h.to(pool.dtype.element_ty), mask=mh)

    return gdn_decode_kernel


def _rows(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def decode_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor, st: StateMetadata | None,
    use_qk_l2norm: bool, block_v: int | None = None, num_warps: int | None = None, out: Tensor | None = None,
) -> Tensor:
    """Row b of q [N, Hk, K], k, v [N, Hv, V], g and beta [N, Hv] is sequence b's only new token; its state is
    ``ssm_state[st.slots[b]]`` ([slots, Hv, K, V]), updated in place. Returns the readout [N, Hv, V] in v's dtype,
    written into ``out`` where given (any row and head strides, V contiguous).
    Snapshots (prefix caching) copy the updated state of their sequence's slot. Only the step's state metadata is
    read: every row's length is 1."""
    global _kernel
    if st is None:
        raise RuntimeError("the gated delta decode kernel needs meta.state")
    if _kernel is None:
        _kernel = _build()
    q, k, v, g, beta = (_rows(x) for x in (q, k, v, g, beta))
    if ssm_state.stride(-1) != 1 or ssm_state.stride(-2) != ssm_state.shape[-1]:
        raise ValueError("the state pool's [K, V] matrices must be row-major")
    n, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    o = torch.empty_like(v) if out is None else out
    if o.shape != v.shape or o.stride(-1) != 1:
        raise ValueError(f"out {tuple(o.shape)} must be v's shape {tuple(v.shape)}, contiguous along V")
    bk = 1 << (kd - 1).bit_length()
    block_v = block_v or BLOCK_V
    grid = (n * hv, (vd + block_v - 1) // block_v)
    _kernel[grid](
        q, k, v, g, beta, o, ssm_state, st.slots, st.has_initial,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        kd**-0.5, H=hk, HV=hv, K=kd, V=vd, BK=bk, BV=block_v, L2NORM=use_qk_l2norm, num_warps=num_warps or NUM_WARPS,
    )  # fmt: skip
    for b, _, slot in st.snapshots:  # n is 1 in a decode step: the state after the only token
        ssm_state[slot].copy_(ssm_state[st.slots_cpu[b]])
    return o


def reference_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, slots: list[int], has_initial: list[bool],
    use_qk_l2norm: bool,
) -> Tensor:
    """The recurrent step in float32 torch, one sequence at a time (transformers' torch_recurrent_gated_delta_rule for
    one token): the probe's reference, independent of the kernel's tiling. Updates ``pool`` in place."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    rep = v.shape[1] // q.shape[1]
    for b, (slot, init) in enumerate(zip(slots, has_initial, strict=True)):
        qb, kb = q[b].float().repeat_interleave(rep, 0), k[b].float().repeat_interleave(rep, 0)  # [Hv, K]
        if use_qk_l2norm:
            qb, kb = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (qb, kb))
        qb = qb * q.shape[-1] ** -0.5
        h = pool[slot].float() if init else torch.zeros(pool.shape[1:], device=pool.device)
        h = h * g[b].float().exp()[:, None, None]
        delta = (v[b].float() - (h * kb[:, :, None]).sum(1)) * beta[b].float()[:, None]  # [Hv, V]
        h = h + kb[:, :, None] * delta[:, None, :]
        out[b] = (h * qb[:, :, None]).sum(1)
        pool[slot] = h.to(pool.dtype)
    return out


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once against ``reference_step`` (3 sequences, one without a state whose slot holds NaN, GVA
    heads); a Triton that cannot compile here or a wrong answer turns it off for the process. (On the CPU only under
    Triton's interpreter, as the tests run it.)"""
    gen = torch.Generator().manual_seed(0)
    n, hk, hv, kd, vd = 3, 2, 4, 64, 64

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen)

    q, k, v = rand(n, hk, kd), rand(n, hk, kd), rand(n, hv, vd)
    g, beta = -torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    pool = rand(5, hv, kd, vd) * 0.1
    pool[1] = float("nan")
    slots, has_initial = [3, 1, 0], [True, False, True]
    want_pool = pool.clone()
    want = reference_step(q, k, v, g, beta, want_pool, slots, has_initial, True)

    def check() -> bool:
        dq, dk, dv, dg, db = (x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta))
        got_pool = pool.to(device=device, dtype=dtype)
        st = StateMetadata(torch.tensor(slots, device=device), slots, torch.tensor(has_initial, device=device),
                           has_initial)  # fmt: skip
        got = decode_step(dq, dk, dv, dg, db, got_pool, st, True).float().cpu()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        return torch.allclose(got, want, rtol=tol, atol=tol) and torch.allclose(
            got_pool.float().cpu()[slots], want_pool[slots], rtol=tol, atol=tol
        )

    return SWITCH.probe(check)
