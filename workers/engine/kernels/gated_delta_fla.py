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

from workers.engine.kernels import fla_tuning
from workers.engine.kernels.attention import AttentionMetadata, StateMetadata

log = logging.getLogger(__name__)

_kernels: tuple[Any, Any, Any] | None = None
_tried = False
# fla's chunk pipeline with its per-chunk states kept (``_chunk_states``): None until tried, False where it failed.
_states: Any = None
CHUNK = 64  # fla's chunk length: the states it keeps are those at every 64th token of a sequence
# The prefill fla's autotunes are timed on (tune_shape): a served chunk's size, the step budget's default.
TUNE_TOKENS = 4096


def _load() -> tuple[Any, Any, Any] | None:
    """fla's (chunk rule, prepare_chunk_indices, fused recurrent rule), imported once; None where it fails."""
    global _kernels, _tried
    if not _tried:
        _tried = True
        if torch.cuda.is_available():  # before fla's first call: its kernels' configs for this card, if shipped
            fla_tuning.use_shipped(torch.device("cuda", torch.cuda.current_device()))
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
            from fla.ops.utils import prepare_chunk_indices

            _kernels = (chunk_gated_delta_rule, prepare_chunk_indices, fused_recurrent_gated_delta_rule)
        except Exception as exc:  # noqa: BLE001 - not installed, or a Triton it cannot use: the torch path serves
            # only ever asked on CUDA, where the torch path is several times slower: say how to get the kernels
            log.warning("flash-linear-attention unavailable (%s: %s); the gated delta rule runs in torch "
                        "(pip install 'glimpse[fla]')", type(exc).__name__, exc)
    return _kernels


def available() -> bool:
    return _load() is not None


def _load_states(like: tuple[Tensor, ...]) -> Any:
    """fla's chunked forward as five calls (l2 norms, decay cumsum, WY representation, state pass, output) instead
    of its one public function, which keeps the state before every 64-token chunk (``h``) internally and hands
    back only the final one. With ``h`` a step's snapshots at chunk-aligned points come out of one call per
    layer, where the public function needs the sequences cut at them (a call per cut). These are fla's internal
    functions, so they are imported and checked against the public function on the device once (``_probe``, on
    inputs shaped and typed ``like`` the first call's q, k, v, g, beta and initial state); any failure leaves the
    rounds path in use."""
    global _states
    if _states is None:
        _states = False
        try:
            from fla.modules.norm.l2norm import l2norm_fwd
            from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
            from fla.ops.common.chunk_o import chunk_fwd_o
            from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
            from fla.ops.utils import chunk_local_cumsum
            from fla.ops.utils.constant import RCP_LN2

            parts = (l2norm_fwd, chunk_local_cumsum, chunk_gated_delta_rule_fwd_intra, chunk_gated_delta_rule_fwd_h,
                     chunk_fwd_o, RCP_LN2)  # fmt: skip
            if _probe(parts, like):
                _states = parts
        except Exception as exc:  # noqa: BLE001 - another fla version: the rounds path serves
            log.info("fla's chunk states unavailable (%s: %s); snapshots inside a chunk cut it into rounds",
                     type(exc).__name__, exc)  # fmt: skip
    return _states or None


def _chunk_states(
    parts: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
    use_qk_l2norm: bool, cu: Tensor, indices: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [1, T, Hv, V], states before each chunk [1, NT, Hv, K, V] in k's dtype, final states float32) for a varlen
    batch ([1, T, ...] inputs): the order of calls of fla's public chunk function, forward only."""
    l2norm_fwd, cumsum, intra, fwd_h, fwd_o, rcp_ln2 = parts
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))  # its public function's input guard does this
    if use_qk_l2norm:
        q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
    g = cumsum(g, chunk_size=CHUNK, scale=rcp_ln2, cu_seqlens=cu, chunk_indices=indices)
    w, u, _ = intra(k=k, v=v, g=g, beta=beta, cu_seqlens=cu, chunk_indices=indices, chunk_size=CHUNK)
    h, v_new, final = fwd_h(
        k=k, w=w, u=u, g=g, initial_state=initial_state, output_final_state=True, cu_seqlens=cu,
        chunk_indices=indices, chunk_size=CHUNK,
    )
    o = fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=k.shape[-1] ** -0.5, cu_seqlens=cu, chunk_indices=indices,
              chunk_size=CHUNK)  # fmt: skip
    return o, h, final


def _probe(parts: Any, like: tuple[Tensor, ...]) -> bool:
    """The five calls against fla's public function on two sequences (70 and 130 tokens, one with a state), once
    on the current CUDA device: outputs and final states must agree to rounding, and the kept state at token 64 of
    the second sequence must equal the public function's final state of its first 64 tokens. The inputs take the
    heads, head dims and dtypes of ``like`` (q, k, v, g, beta [1, T, ...], initial state [N, ...]), so the kernels
    this compiles and autotunes are the ones serving calls: fla autotunes per head count, dims and dtypes, and a
    probe at shapes of its own paid ~60 candidates' compiles no request used (a cold 9B start, H200)."""
    kernels = _load()
    if kernels is None or not torch.cuda.is_available():
        return False
    chunk_rule, chunk_indices, _ = kernels
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = [70, 130]

    def rand(like_t: Tensor, *lead: int) -> Tensor:
        shape = (*lead, *like_t.shape[len(lead) :])
        return torch.randn(*shape, device="cuda", generator=gen).to(like_t.dtype)

    t = sum(lens)
    lq, lk, lv, lg, lbeta, lh0 = like
    q, k, v = rand(lq, 1, t), rand(lk, 1, t), rand(lv, 1, t)
    g = -torch.rand(1, t, *lg.shape[2:], device="cuda", generator=gen).to(lg.dtype)
    beta = torch.rand(1, t, *lbeta.shape[2:], device="cuda", generator=gen).to(lbeta.dtype)
    h0 = (rand(lh0, 2).float() * 0.1).to(lh0.dtype)
    h0[0] = 0
    host = torch.tensor([0, lens[0], t], dtype=torch.int64)
    cu = host.cuda()
    indices = chunk_indices(cu, CHUNK, cu_seqlens_cpu=host)
    want_o, want_final = chunk_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=host,
                                    chunk_indices=indices)  # fmt: skip
    o, h, final = _chunk_states(parts, q, k, v, g, beta, h0, True, cu, indices)
    s = slice(lens[0], lens[0] + CHUNK)
    host1 = torch.tensor([0, CHUNK], dtype=torch.int64)
    _, at64 = chunk_rule(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], initial_state=h0[1:], output_final_state=True,
                         use_qk_l2norm_in_kernel=True, cu_seqlens=host1.cuda(), cu_seqlens_cpu=host1)  # fmt: skip
    first_chunks = (lens[0] + CHUNK - 1) // CHUNK  # the second sequence's chunks start after the first's
    ok = all(
        # TF32 dots, and the kept states in k's dtype (bf16: ~3e-3); a wrong call is off by O(1)
        ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2
        for a, b in ((o, want_o), (final, want_final), (h[0, first_chunks + 1], at64[0]))
    )
    if not ok:
        log.warning("fla's chunk states disagree with its public function; snapshots inside a chunk cut it into rounds")
    return ok


def tune_shape(heads_k: int, heads_v: int, head_k: int, head_v: int, dtype: torch.dtype, tokens: int = TUNE_TOKENS,
               seqs: int = 2, device: torch.device | str = "cuda") -> bool:
    """fla's chunk kernels at one layer's per-rank shape, called as serving calls them (the public chunk function
    with initial states in the pools' ``dtype``, the kept-states pipeline, the rounds path with float32 states) on
    a prefill of ``tokens`` tokens in ``seqs`` sequences, so that each autotune, keyed by shape and dtypes only,
    times its candidates at a served chunk's size rather than at whichever call came first (a warm-up's few
    tokens). Then the kept-states probe at this shape. benchmarks/kernels/fla_configs.py writes the configs to ship
    from this. Whether fla is usable here and the probe passed."""
    kernels = _load()
    if kernels is None or not torch.cuda.is_available():
        return False
    chunk_rule, chunk_indices, _ = kernels
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    q, k, v = rand(1, tokens, heads_k, head_k), rand(1, tokens, heads_k, head_k), rand(1, tokens, heads_v, head_v)
    g = -torch.rand(1, tokens, heads_v, device=device, generator=gen)
    beta = torch.rand(1, tokens, heads_v, device=device, generator=gen).to(dtype)
    host = torch.linspace(0, tokens, seqs + 1).to(torch.int64)
    cu = host.to(device)
    indices = chunk_indices(cu, CHUNK, cu_seqlens_cpu=host)
    h0 = rand(seqs, heads_v, head_k, head_v, scale=0.1)
    like = (q, k, v, g, beta, h0)
    for state in (h0, h0.float()):
        chunk_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                   cu_seqlens=cu, cu_seqlens_cpu=host, chunk_indices=indices)  # fmt: skip
    probed = _states is None  # _load_states probes at the first shape a process calls it with: this one
    parts = _load_states(like)
    if parts is None:
        return False
    _chunk_states(parts, q, k, v, g, beta, h0, True, cu, indices)
    return probed or _probe(parts, like)


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
        scale=q.shape[-1] ** -0.5, initial_state=_gather(ssm_state, meta), output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    ssm_state.index_copy_(0, st.slots, final.to(ssm_state.dtype))
    for b, _, slot in st.snapshots:  # n is 1 here: the state after the only token
        ssm_state[slot].copy_(final[b])
    return o.squeeze(1)


def _gather(pool: Tensor, meta: AttentionMetadata) -> Tensor:
    """The sequences' states in the pool's dtype (fla's kernels read h0 as float32 themselves), zeros where a
    sequence has no initial state: masked_fill, not a multiply, as the slot may hold NaN from an earlier owner. The
    mask is the step's, made once for every layer (kept in ``meta.derived``)."""
    assert meta.state is not None
    fresh = meta.derived.get("gdn_fresh")
    if fresh is None:
        fresh = meta.derived["gdn_fresh"] = ~meta.state.has_initial.view(-1, 1, 1, 1)
    return pool.index_select(0, meta.state.slots).masked_fill_(fresh, 0)


def _to_device(meta: AttentionMetadata, arrays: list[Tensor]) -> list[Tensor]:
    """Host int64 index arrays on the model's device with one copy: packed into one pinned buffer, each at a
    16-byte boundary (Triton specialises pointer arguments on that alignment: a view at an 8-byte offset would
    compile a second variant of every fla kernel). A pageable copy would wait for every kernel queued before it."""
    device = meta.query_start_loc.device
    sizes = [a.numel() for a in arrays]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n + n % 2)
    host = torch.zeros(offsets[-1], dtype=torch.int64)
    for a, at, n in zip(arrays, offsets, sizes):
        host[at : at + n] = a.flatten()
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    return [flat[at : at + n].view(a.shape) for a, at, n in zip(arrays, offsets, sizes)]


def _varlen(meta: AttentionMetadata, starts: list[int], chunk_indices: Any) -> tuple[Tensor, Tensor, Tensor]:
    """cu_seqlens on the device and the host, and fla's chunk indices, for the whole step: the same objects for
    every layer (kept in ``meta.derived``), so fla's identity-keyed caches hit and nothing is read back."""
    found = meta.derived.get("gdn_varlen")
    if found is None:
        host = torch.tensor(starts, dtype=torch.int64)
        cu, indices = _to_device(meta, [host, chunk_indices(host, CHUNK, cu_seqlens_cpu=host)])
        found = (cu, host, indices)
        meta.derived["gdn_varlen"] = found
    return found


def _aligned(meta: AttentionMetadata, st: StateMetadata) -> bool:
    """Whether every snapshot inside a sequence (not at its end) falls after a whole number of fla's chunks."""
    return all(n % CHUNK == 0 for b, n, _ in st.snapshots if n < meta.query_lens_cpu[b])


def _state_plan(meta: AttentionMetadata, st: StateMetadata) -> list[Tensor]:
    """Where each snapshot comes from, for the whole step (kept in ``meta.derived``, built once for all layers):
    rows of the kept chunk states and their slots for snapshots inside sequences, sequences and slots for those at
    a sequence's end."""
    found = meta.derived.get("gdn_state_plan")
    if found is None:
        first = [0]  # sequence b's chunks start at row first[b] of fla's kept states
        for n in meta.query_lens_cpu:
            first.append(first[-1] + (n + CHUNK - 1) // CHUNK)
        inside = [(first[b] + n // CHUNK, slot) for b, n, slot in st.snapshots if n < meta.query_lens_cpu[b]]
        at_end = [(b, slot) for b, n, slot in st.snapshots if n == meta.query_lens_cpu[b]]
        found = _to_device(meta, [torch.tensor(col, dtype=torch.int64) for pairs in (inside, at_end)
                                  for col in ([x for x, _ in pairs], [y for _, y in pairs])])  # fmt: skip
        meta.derived["gdn_state_plan"] = found
    return found


Round = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[tuple[int, int]]]


def _round_plan(meta: AttentionMetadata, st: StateMetadata, starts: list[int], chunk_indices: Any) -> list[Round]:
    """Each round's (rows, cu_seqlens, cu_seqlens on the host, sequences, chunk indices, snapshots as (piece,
    slot)) for the whole step, on the device with one copy (kept in ``meta.derived``)."""
    found = meta.derived.get("gdn_rounds")
    if found is None:
        ends: dict[tuple[int, int], list[int]] = {}
        for b, n, slot in st.snapshots:
            ends.setdefault((b, n), []).append(slot)
        arrays: list[Tensor] = []
        snaps: list[list[tuple[int, int]]] = []
        for pieces in _segments(meta, st, starts):
            cu = [0]
            for _, s, e in pieces:
                cu.append(cu[-1] + e - s)
            cu_host = torch.tensor(cu, dtype=torch.int64)
            arrays += [torch.cat([torch.arange(s, e) for _, s, e in pieces]), cu_host,
                       torch.tensor([b for b, _, _ in pieces], dtype=torch.int64),
                       chunk_indices(cu_host, CHUNK, cu_seqlens_cpu=cu_host)]  # fmt: skip
            snaps.append([(i, slot) for i, (b, _, e) in enumerate(pieces) for slot in ends.get((b, e - starts[b]), [])])
        dev = _to_device(meta, arrays)
        found = [(dev[4 * r], dev[4 * r + 1], arrays[4 * r + 1], dev[4 * r + 2], dev[4 * r + 3], snaps[r])
                 for r in range(len(snaps))]  # fmt: skip
        meta.derived["gdn_rounds"] = found
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
    if all(n == meta.query_lens_cpu[b] for b, n, _ in st.snapshots):
        # No sequence cut: one varlen call over the whole batch, decodes included.
        cu, cu_host, indices = _varlen(meta, starts, chunk_indices)
        o, final = chunk_rule(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
            initial_state=_gather(ssm_state, meta), output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
            cu_seqlens=cu, cu_seqlens_cpu=cu_host, chunk_indices=indices,
        )
        ssm_state.index_copy_(0, st.slots, final.to(ssm_state.dtype))
        for b, _, slot in st.snapshots:  # every snapshot here is at its sequence's end
            ssm_state[slot].copy_(final[b])
        return o.squeeze(0)

    h0 = _gather(ssm_state, meta) if _aligned(meta, st) else None  # the rounds below take it too, if left to them
    parts = None if h0 is None else _load_states(
        (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0), h0))
    if parts is not None and h0 is not None and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        # Every cut at a multiple of fla's chunk: one call, the snapshots read from the states it keeps.
        cu, cu_host, indices = _varlen(meta, starts, chunk_indices)
        o, h, final = _chunk_states(
            parts, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0), h0,
            use_qk_l2norm, cu, indices,
        )
        plan = _state_plan(meta, st)
        ssm_state.index_copy_(0, st.slots, final.to(ssm_state.dtype))
        ssm_state.index_copy_(0, plan[1], h[0].index_select(0, plan[0]).to(ssm_state.dtype))
        ssm_state.index_copy_(0, plan[3], final.index_select(0, plan[2]).to(ssm_state.dtype))
        return o.squeeze(0)

    # Other snapshots inside sequences: round k runs every sequence's k-th piece in one varlen call, from the
    # states round k-1 left (float32 between rounds, as fla hands them back).
    out = torch.empty_like(v)
    state = (_gather(ssm_state, meta) if h0 is None else h0).float()
    for rows, cu, cu_host, seqs, indices, snaps in _round_plan(meta, st, starts, chunk_indices):
        o, final = chunk_rule(
            *(t.index_select(0, rows).unsqueeze(0) for t in (q, k, v, g, beta)),
            initial_state=state.index_select(0, seqs), output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu, cu_seqlens_cpu=cu_host, chunk_indices=indices,
        )
        out.index_copy_(0, rows, o.squeeze(0))
        state.index_copy_(0, seqs, final)
        for i, slot in snaps:
            ssm_state[slot].copy_(final[i])
    ssm_state.index_copy_(0, st.slots, state.to(ssm_state.dtype))
    return out
