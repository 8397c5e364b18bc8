"""Gated DeltaNet's token mixing over a flattened batch with per-sequence state pools: the causal depthwise conv1d
and the gated delta rule (Qwen3.5 / Qwen3-Next linear attention).

A step's new tokens are B sequences one after another (``AttentionMetadata.query_start_loc``); sequence b keeps its
state in slot ``meta.state.slots[b]`` of each pool and starts from zeros where ``meta.state.has_initial[b]`` is
False. Both functions leave every sequence's state after its last new token in its slot, and write the snapshots
``meta.state.snapshots`` asks for (the state after the first n new tokens of a sequence, into another slot).

API (implemented by the kernels owner; the model family calls exactly these):

    causal_conv1d(x [T, C], weight [C, K], bias [C] | None, conv_state [S, C, K-1], meta, activation="silu") -> [T, C]
    causal_conv1d_sections(..., sections) -> [[T, C_0], [T, C_1], ...]  (the same, split by channels)
    gated_delta_rule(q [T, Hk, Dk], k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv], beta [T, Hv], ssm_state [S, Hv, Dk, Dv],
                     meta, use_qk_l2norm=True) -> [T, Hv, Dv]

Both compute in float32 (as transformers' reference does) and store states back in the pools' dtype. The conv is
plain torch on the CPU (one grouped conv over the whole batch; elementwise ops for an all-decode step); on CUDA a
step with prefill runs it in one Triton kernel over the pool in place (causal_conv.py), an all-decode step in another
(conv_decode.py). The
gated delta rule of an all-decode step on CUDA is glimpse's Triton kernel that updates the pool in place
(gated_delta_decode.py, unless ``GLIMPSE_TRITON_GDN_DECODE=0`` or its probe failed); a step with prefill runs
flash-linear-attention's chunked kernels (gated_delta_fla.py, which also holds fla's fused recurrent step as the decode
fallback) where ``fla`` imports and the tensors are on CUDA, unless ``GLIMPSE_FLA=0``, its leading decodes on the
in-place kernel. Everything else takes the torch path here: the reference's chunked algorithm (chunk 64, same op
order) for a sequence of several new tokens, its recurrent step for one of a single token.

An all-decode step (every query length 1) does no host sync and branches only on the host lists, on either path,
so it can be captured in a CUDA graph (padding rows may share a scratch slot).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.engine.kernels import causal_conv, conv_decode, fused, gated_delta_decode, gated_delta_fla
from workers.engine.kernels.attention import (
    AttentionMetadata,
    StateMetadata,
    decode_prefix,
    sequence_of_rows,
    tail_metadata,
)

CHUNK = 64  # the reference's chunk_size: the chunked results match it only with the same chunking


def _state(meta: AttentionMetadata) -> StateMetadata:
    if meta.state is None:
        raise ValueError("gated delta kernels need meta.state (the linear-attention state slots)")
    return meta.state


def _starts(meta: AttentionMetadata) -> list[int]:
    """Host prefix sums of the query lengths: sequence b's rows are starts[b]..starts[b+1]."""
    starts = [0]
    for n in meta.query_lens_cpu:
        starts.append(starts[-1] + n)
    return starts


def _all_decode(meta: AttentionMetadata) -> bool:
    return all(n == 1 for n in meta.query_lens_cpu)


def _initial(pool: Tensor, st: StateMetadata) -> Tensor:
    """Every sequence's state before its new tokens, float32; zeros where it has none."""
    return st.initial(pool).float()


def _activate(y: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r} (silu, swish or None)")


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    meta: AttentionMetadata,
    activation: str | None = "silu",
    fuse: bool = False,
) -> Tensor:
    """Depthwise causal conv over each sequence's new tokens, its window of the K-1 inputs before them taken from
    ``conv_state`` (zeros without initial state); the window after them is written back (and to snapshot slots).
    On CUDA an all-decode step takes the Triton kernel that shifts each window in place (conv_decode.py); where it
    is off, ``fuse`` (the layer's fused flag) makes its SiLU'd conv one compiled kernel (fused.py). Other steps on
    CUDA take the Triton kernel that reads the windows from the pool in place (causal_conv.py)."""
    st = _state(meta)
    if _on_triton(x, activation) and _all_decode(meta) and weight.shape[1] > 1 and conv_decode.available():
        return conv_decode.decode_step(x, weight, bias, conv_state, st, activation is not None)
    if fuse and bias is None and activation in ("silu", "swish") and _all_decode(meta):
        out, after = fused.compiled(fused.conv_decode)(conv_state, st.slots, st.has_initial, x, weight)
        conv_state.index_copy_(0, st.slots, after)
        for b, _, slot in st.snapshots:
            conv_state[slot].copy_(after[b])
        return out
    if _triton_conv(x, weight, activation, meta):
        return causal_conv.conv(x, weight, bias, conv_state, st, meta.query_start_loc, _starts(meta)[:-1],
                                activation is not None, _rows_sequence(meta, x.shape[0]))  # fmt: skip
    tokens, channels = x.shape
    width = weight.shape[1] - 1  # the window: K-1 inputs
    batch = st.slots.shape[0]
    device = x.device
    w32 = weight.float()
    b32 = None if bias is None else bias.float()
    windows = _initial(conv_state, st).transpose(1, 2)  # [B, K-1, C]: oldest input first

    if _all_decode(meta):
        # One token per sequence: [window; x] is each row's whole receptive field, so the conv is a weighted sum
        # over K taps. Elementwise ops only (no cuDNN algorithm choice, nothing data-dependent): graph-capturable.
        field = torch.cat([windows, x.float().unsqueeze(1)], dim=1)  # [B, K, C]
        y = (field * w32.t()).sum(dim=1)
        if b32 is not None:
            y = y + b32
        conv_state.index_copy_(0, st.slots, field[:, 1:].transpose(1, 2).to(conv_state.dtype))
        for b, _, slot in st.snapshots:  # n is 1 here: the state after the only token
            conv_state[slot].copy_(field[b, 1:].t())
        return _activate(y, activation).to(x.dtype)

    # Lay every sequence out as [its window; its new tokens] one after another ("ext" rows), then one grouped conv
    # without padding over all of it: output row r sees ext rows r..r+K-1, so for sequence b's token i (ext row
    # start_b + b*(K-1) + (K-1) + i) it is exactly the window and tokens of b. Rows spanning two sequences are
    # dropped. The row indices come from device tensors only (no host sync).
    seq = sequence_of_rows(meta.query_start_loc, tokens)
    token_rows = torch.arange(tokens, device=device) + (seq + 1) * width
    span = torch.arange(width, device=device)
    first = meta.query_start_loc[:-1].long() + torch.arange(batch, device=device) * width  # window start of each b
    ext = torch.empty(tokens + batch * width, channels, dtype=torch.float32, device=device)
    ext[(first.unsqueeze(1) + span).flatten()] = windows.reshape(batch * width, channels)
    ext[token_rows] = x.float()
    y = F.conv1d(ext.t().unsqueeze(0), w32.unsqueeze(1), b32, groups=channels)[0].t()  # [rows - (K-1), C]
    out = _activate(y[token_rows - width], activation).to(x.dtype)

    # The window after sequence b's n-th token is ext rows first_b + n .. first_b + n + K-2 (its last K-1 inputs,
    # reaching back into the old window when n < K-1).
    last = (meta.query_start_loc[1:].long() + torch.arange(batch, device=device) * width).unsqueeze(1) + span
    conv_state.index_copy_(0, st.slots, ext[last].transpose(1, 2).to(conv_state.dtype))
    starts = _starts(meta)
    for b, n, slot in st.snapshots:
        row = starts[b] + b * width + n
        conv_state[slot].copy_(ext[row : row + width].t())
    return out


def causal_conv1d_sections(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    meta: AttentionMetadata,
    sections: Sequence[int],
    activation: str | None = "silu",
    fuse: bool = False,
) -> list[Tensor]:
    """``causal_conv1d`` split into consecutive channel ``sections`` (Gated DeltaNet's q, k, v). Where the Triton
    kernel serves, each section comes out contiguous ([T, width], the layout fla's chunked kernels take, so they copy
    nothing); elsewhere they are views of the one [T, C] result, as ``split`` gives them."""
    st = _state(meta)
    if _triton_conv(x, weight, activation, meta):
        return causal_conv.conv_sections(x, weight, bias, conv_state, st, meta.query_start_loc, _starts(meta)[:-1],
                                         activation is not None, sections, _rows_sequence(meta, x.shape[0]))  # fmt: skip
    return list(causal_conv1d(x, weight, bias, conv_state, meta, activation, fuse).split(list(sections), dim=-1))


def _on_triton(x: Tensor, activation: str | None) -> bool:
    """Whether the conv kernels in Triton (causal_conv.py, conv_decode.py) can take x: CUDA, an activation they have."""
    return x.is_cuda and activation in ("silu", "swish", None)


def _triton_conv(x: Tensor, weight: Tensor, activation: str | None, meta: AttentionMetadata) -> bool:
    """Whether a step's conv takes causal_conv.py's kernel: one it can take (its width too), with prefill rows in
    the step."""
    return (_on_triton(x, activation) and causal_conv.takes(weight.shape[1]) and not _all_decode(meta)
            and causal_conv.available())  # fmt: skip


def _rows_sequence(meta: AttentionMetadata, tokens: int) -> Tensor:
    """Each row's sequence: the same for every layer of the step (kept in ``meta.derived``)."""
    seq_of = meta.derived.get("conv_seq_of")
    if seq_of is None:
        seq_of = meta.derived["conv_seq_of"] = sequence_of_rows(meta.query_start_loc, tokens)
    return seq_of


def _l2norm(x: Tensor) -> Tensor:
    """transformers' l2norm (eps 1e-6), in float32."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _chunk_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One sequence's run (q, k [n, H, Dk] normalized and q scaled; v [n, H, Dv]; g, beta [n, H]; state [H, Dk, Dv];
    all float32) by the reference's chunked algorithm: the same padding, op order and solver, so float32 results
    match ``torch_chunk_gated_delta_rule`` to rounding. Returns the output [n, H, Dv] and the state after it."""
    n, heads, _ = q.shape
    pad = (CHUNK - n % CHUNK) % CHUNK
    # [H, n, D] padded to whole chunks with zeros (k = beta = g = 0 on padding leaves the state as it is).
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t.t(), (0, pad)) for t in (beta, g))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(heads, -1, CHUNK, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(heads, -1, CHUNK)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)  # log of the decay from the chunk's start to each position
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # decay j -> i
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    # The UT transform: unit lower-triangular solves condense the chunk's delta updates into matmuls.
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_v)
    for i in range(new_v.shape[1]):  # the sequential scan: each chunk reads the state the previous one left
        v_new = new_v[:, i] - k_cum[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, out.shape[-1])[:, :n].transpose(0, 1), state


def _recurrent_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token for each of N sequences (q, k [N, H, Dk] normalized and q scaled; v [N, H, Dv]; g, beta [N, H];
    state [N, H, Dk, Dv]), the reference's recurrent step."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def _snapshot_points(st: StateMetadata, batch: int) -> list[dict[int, list[int]]]:
    """Per sequence: n -> the slots that want its state after its first n new tokens."""
    points: list[dict[int, list[int]]] = [{} for _ in range(batch)]
    for b, n, slot in st.snapshots:
        points[b].setdefault(n, []).append(slot)
    return points


def _torch_gated_delta(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor, meta: AttentionMetadata,
    use_qk_l2norm: bool,
) -> Tensor:
    st = _state(meta)
    tokens, k_heads, k_dim = q.shape
    v_heads = v.shape[1]
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    if v_heads != k_heads:  # each q/k head serves v_heads // k_heads consecutive value heads
        qf = qf.repeat_interleave(v_heads // k_heads, dim=1)
        kf = kf.repeat_interleave(v_heads // k_heads, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    states = _initial(ssm_state, st)  # [B, Hv, Dk, Dv]

    if _all_decode(meta):  # rows are sequences: one vectorized step, no host sync
        out, states = _recurrent_step(qf / k_dim**0.5, kf, vf, gf, bf, states)
        ssm_state.index_copy_(0, st.slots, states.to(ssm_state.dtype))
        for b, _, slot in st.snapshots:
            ssm_state[slot].copy_(states[b])
        return out.to(v.dtype)

    out = torch.empty(tokens, v_heads, v.shape[2], dtype=torch.float32, device=v.device)
    starts = _starts(meta)
    points = _snapshot_points(st, len(meta.query_lens_cpu))
    singles = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
    if singles:  # the decodes of a mixed step, together
        rows = torch.tensor([starts[b] for b in singles], device=v.device)
        seqs = torch.tensor(singles, device=v.device)
        step_out, step_states = _recurrent_step(
            qf[rows] / k_dim**0.5, kf[rows], vf[rows], gf[rows], bf[rows], states[seqs]
        )
        out[rows] = step_out
        states[seqs] = step_states
    scale = k_dim**-0.5  # the chunked reference multiplies; its recurrent step divides by sqrt(Dk)
    for b, n in enumerate(meta.query_lens_cpu):
        if n == 1:
            continue
        # Segments end at the snapshot points and at the sequence's end; the state runs on across them.
        state, begin = states[b], 0
        for end in sorted({*points[b], n}):
            s, e = starts[b] + begin, starts[b] + end
            out[s:e], state = _chunk_rule(qf[s:e] * scale, kf[s:e], vf[s:e], gf[s:e], bf[s:e], state)
            begin = end
            for slot in points[b].get(end, []):
                ssm_state[slot].copy_(state)
        states[b] = state
    ssm_state.index_copy_(0, st.slots, states.to(ssm_state.dtype))
    for b in singles:
        for slot in points[b].get(1, []):
            ssm_state[slot].copy_(states[b])
    return out.to(v.dtype)


def fla_path(device: torch.device) -> bool:
    """Whether gated_delta_rule takes flash-linear-attention's kernels for tensors on ``device``."""
    if device.type != "cuda" or os.environ.get("GLIMPSE_FLA", "1") == "0":
        return False
    return gated_delta_fla.available()  # imports fla on first use only: never on a CPU-only step


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    ssm_state: Tensor,
    meta: AttentionMetadata,
    use_qk_l2norm: bool = True,
    out: Tensor | None = None,
) -> Tensor:
    """The gated delta rule of transformers' ``torch_chunk_gated_delta_rule`` (prefill) and
    ``torch_recurrent_gated_delta_rule`` (decode) for every sequence, from and back into ``ssm_state``. The readout
    [T, Hv, Dv] is written into ``out`` where given (piecewise graphs' static buffer): the decode kernel's rows
    straight from the kernel, the rest copied once."""
    if v.shape[1] % q.shape[1] != 0:
        raise ValueError(f"value heads ({v.shape[1]}) must be a multiple of key heads ({q.shape[1]})")
    decode = all(n == 1 for n in meta.query_lens_cpu)
    in_place = q.is_cuda and gated_delta_decode.available()  # the pool read and written in place
    if decode and in_place:
        return gated_delta_decode.decode_step(q, k, v, g, beta, ssm_state, meta.state, use_qk_l2norm, out=out)
    if fla_path(q.device):
        split = decode_split(meta) if in_place and not decode else None
        if split is not None:
            return mixed_step(q, k, v, g, beta, ssm_state, split, use_qk_l2norm, out)
        if decode:
            result = gated_delta_fla.decode_step(q, k, v, g, beta, ssm_state, meta, use_qk_l2norm)
        else:
            result = gated_delta_fla.gated_delta_rule(q, k, v, g, beta, ssm_state, meta, use_qk_l2norm)
    else:
        result = _torch_gated_delta(q, k, v, g, beta, ssm_state, meta, use_qk_l2norm)
    return result if out is None else out.copy_(result)


Split = tuple[int, StateMetadata, AttentionMetadata]


def _state_rows(st: StateMetadata, lo: int, hi: int) -> StateMetadata:
    return StateMetadata(
        slots=st.slots[lo:hi], slots_cpu=st.slots_cpu[lo:hi], has_initial=st.has_initial[lo:hi],
        has_initial_cpu=st.has_initial_cpu[lo:hi],
        snapshots=[(b - lo, n, slot) for b, n, slot in st.snapshots if lo <= b < hi],
    )  # fmt: skip


def decode_split(meta: AttentionMetadata) -> Split | None:
    """A mixed step's leading one-token rows (the scheduler puts decodes first) apart from the rest: (rows, their
    state metadata, the rest's metadata), made once per step (kept in ``meta.derived``, so each part's own derived values
    are shared by every layer too); None where the step does not start with such rows or has nothing else."""
    if "gdn_split" not in meta.derived:
        rows, split = decode_prefix(meta), None
        if meta.state is not None and 0 < rows < len(meta.query_lens_cpu):
            tail = tail_metadata(meta, rows)
            tail.state = _state_rows(meta.state, rows, len(meta.query_lens_cpu))
            split = (rows, _state_rows(meta.state, 0, rows), tail)
        meta.derived["gdn_split"] = split
    found: Split | None = meta.derived["gdn_split"]
    return found


def mixed_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor, split: Split, use_qk_l2norm: bool,
    out: Tensor | None = None,
) -> Tensor:
    """A step of decodes and prefill chunks: the decodes on the in-place kernel, the chunks on fla's chunked
    pipeline. Through fla alone every decode row was a chunk of its own (64 rows of work for one) and every state
    crossed memory six times (gather, fill, float32 final, cast, scatter). The two parts hold different slots. The
    decode kernel writes its rows of the readout (``out``, or a new tensor) itself; fla's are copied after them."""
    rows, head, tail = split
    out = torch.empty_like(v) if out is None else out
    gated_delta_decode.decode_step(q[:rows], k[:rows], v[:rows], g[:rows], beta[:rows], ssm_state, head,
                                   use_qk_l2norm, out=out[:rows])  # fmt: skip
    rest = gated_delta_fla.gated_delta_rule(q[rows:], k[rows:], v[rows:], g[rows:], beta[rows:], ssm_state, tail,
                                            use_qk_l2norm)  # fmt: skip
    out[rows:].copy_(rest)
    return out
