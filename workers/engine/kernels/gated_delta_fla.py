"""The gated delta rule on CUDA through flash-linear-attention (pip ``fla-core``, import ``fla``, MIT): its Triton
chunked kernel over the whole varlen batch for steps with prefill (decode rows ride along as one-token sequences), and
its fused recurrent kernel for an all-decode step. The semantics are the torch path's,
up to rounding.

fla keeps no state pools: each sequence's state is gathered from its slot (zeros without initial state), passed as
``initial_state`` [N, Hv, Dk, Dv], and the final states (float32) are scattered back into the pool's dtype.

fla is optional, not a declared dependency: where it imports, transformers' Qwen3.5 swaps its reference functions
for fla's Triton kernels on every device, so installing it on a CPU-only machine breaks the CPU reference runs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels.attention import AttentionMetadata, StateMetadata

log = logging.getLogger(__name__)

_kernels: tuple[Any, Any, Any] | None = None
_tried = False


def _load() -> tuple[Any, Any, Any] | None:
    """fla's (chunk rule, prepare_chunk_indices, fused recurrent rule), imported once; None where it fails."""
    global _kernels, _tried
    if not _tried:
        _tried = True
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
            from fla.ops.utils import prepare_chunk_indices

            _kernels = (chunk_gated_delta_rule, prepare_chunk_indices, fused_recurrent_gated_delta_rule)
        except Exception as exc:  # noqa: BLE001 - not installed, or a Triton it cannot use: the torch path serves
            log.info("flash-linear-attention unavailable (%s: %s); the gated delta rule runs in torch", type(exc).__name__, exc)
    return _kernels


def available() -> bool:
    return _load() is not None


def decode_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor, meta: AttentionMetadata,
    use_qk_l2norm: bool,
) -> Tensor:
    """An all-decode step (row b is sequence b's only new token) on fla's fused recurrent kernel: one launch for
    the l2 norms, decay, delta update and readout of every head, where the torch step takes about twenty
    (Qwen3.5-35B-A3B, 20 layers, batch 1 on an H200: most of a decode step was kernel launches). Batch of N
    sequences of one token each ([N, 1, H, K]: no varlen indices), so it is CUDA-graph safe. The kernel reads q, k, v,
    g and beta in their dtypes and computes in float32; fewer key than value heads is its GVA (value head j reads key
    head j // (Hv / Hk), as the torch path's repeat_interleave)."""
    kernels = _load()
    if kernels is None or meta.state is None:
        raise RuntimeError("the fla path needs flash-linear-attention and meta.state")
    st = meta.state
    # Keywords only: fla's signature has gk and gv between g and beta.
    o, final = kernels[2](
        q=q.unsqueeze(1), k=k.unsqueeze(1), v=v.unsqueeze(1), g=g.unsqueeze(1), beta=beta.unsqueeze(1),
        scale=q.shape[-1] ** -0.5, initial_state=_gather(ssm_state, st), output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    ssm_state.index_copy_(0, st.slots, final.to(ssm_state.dtype))
    for b, _, slot in st.snapshots:  # n is 1 here: the state after the only token
        ssm_state[slot].copy_(final[b])
    return o.squeeze(1)


def _gather(pool: Tensor, st: StateMetadata) -> Tensor:
    """The sequences' states in the pool's dtype (fla's kernels read h0 as float32 themselves), zeros where a
    sequence has no initial state: masked_fill, not a multiply, as the slot may hold NaN from an earlier owner."""
    h0 = pool.index_select(0, st.slots)
    return h0.masked_fill_(~st.has_initial.view(-1, 1, 1, 1), 0)


def _varlen(meta: AttentionMetadata, starts: list[int], chunk_indices: Any) -> tuple[Tensor, Tensor, Tensor]:
    """cu_seqlens on the device and the host, and fla's chunk indices, for the whole step: the same objects for
    every layer (kept in ``meta.derived``), so fla's identity-keyed caches hit and nothing is read back."""
    found = meta.derived.get("gdn_varlen")
    if found is None:
        host = torch.tensor(starts, dtype=torch.int64)
        device = meta.query_start_loc.to(torch.int64)
        found = (device, host, chunk_indices(device, 64, cu_seqlens_cpu=host))
        meta.derived["gdn_varlen"] = found
    return found


def _segments(meta: AttentionMetadata, st: StateMetadata, starts: list[int]) -> list[list[tuple[int, int, int]]]:
    """Rounds of (sequence, first row, end row): a sequence is cut at its snapshot points inside it (not at its
    end), its k-th piece going into round k; a step without such cuts is one round of whole sequences."""
    cuts: list[set[int]] = [set() for _ in meta.query_lens_cpu]
    for b, n, _ in st.snapshots:
        if n < meta.query_lens_cpu[b]:
            cuts[b].add(n)
    rounds: list[list[tuple[int, int, int]]] = []
    for b, n in enumerate(meta.query_lens_cpu):
        begin = 0
        for r, end in enumerate(sorted({*cuts[b], n})):
            if r == len(rounds):
                rounds.append([])
            rounds[r].append((b, starts[b] + begin, starts[b] + end))
            begin = end
    return rounds


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor, meta: AttentionMetadata,
    use_qk_l2norm: bool,
) -> Tensor:
    """gated_delta.gated_delta_rule on fla's kernels (same arguments and results)."""
    kernels = _load()
    if kernels is None or meta.state is None:
        raise RuntimeError("the fla path needs flash-linear-attention and meta.state")
    chunk_rule, chunk_indices, _ = kernels
    st = meta.state

    starts = [0]
    for n in meta.query_lens_cpu:
        starts.append(starts[-1] + n)
    rounds = _segments(meta, st, starts)
    ends: dict[tuple[int, int], list[int]] = {}
    for b, n, slot in st.snapshots:
        ends.setdefault((b, n), []).append(slot)

    if len(rounds) == 1:  # no sequence cut: one varlen call over the whole batch, decodes included
        cu, cu_host, indices = _varlen(meta, starts, chunk_indices)
        o, final = chunk_rule(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
            initial_state=_gather(ssm_state, st), output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
            cu_seqlens=cu, cu_seqlens_cpu=cu_host, chunk_indices=indices,
        )
        ssm_state.index_copy_(0, st.slots, final.to(ssm_state.dtype))
        for (b, _), slots in ends.items():  # every snapshot here is at its sequence's end
            for slot in slots:
                ssm_state[slot].copy_(final[b])
        return o.squeeze(0)

    # Snapshots inside sequences: round k runs every sequence's k-th piece in one varlen call, from the states
    # round k-1 left (float32 between rounds, as fla hands them back).
    out = torch.empty_like(v)
    state = _gather(ssm_state, st).float()
    for pieces in rounds:
        rows = torch.cat([torch.arange(s, e) for _, s, e in pieces]).to(q.device, non_blocking=True)
        host = [0]
        for _, s, e in pieces:
            host.append(host[-1] + e - s)
        cu_host = torch.tensor(host, dtype=torch.int64)
        cu = cu_host.to(q.device, non_blocking=True)
        seqs_host = [b for b, _, _ in pieces]
        seqs = torch.tensor(seqs_host, device=q.device)
        o, final = chunk_rule(
            *(t.index_select(0, rows).unsqueeze(0) for t in (q, k, v, g, beta)),
            initial_state=state.index_select(0, seqs), output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu, cu_seqlens_cpu=cu_host,
            chunk_indices=chunk_indices(cu, 64, cu_seqlens_cpu=cu_host),
        )
        out.index_copy_(0, rows, o.squeeze(0))
        state.index_copy_(0, seqs, final)
        for i, (b, _, e) in enumerate(pieces):
            for slot in ends.get((b, e - starts[b]), []):
                ssm_state[slot].copy_(final[i])
    ssm_state.index_copy_(0, st.slots, state.to(ssm_state.dtype))
    return out
