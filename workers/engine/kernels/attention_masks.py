"""Which keys a new token sees on sliding-window and in-image bidirectional layers, for every backend.

The rule is transformers' Gemma 4 sliding-layer mask, AND(window, OR(causal, same image)), on absolute positions:
query i sees key j when ``j <= i`` or both sit in the same span of ``meta.bidir_spans``, and, on a sliding layer of
window w, ``j > i - w`` (``sliding_window_overlay``). Because a span's keys run from its start to its end and the
causal part already covers ``[0, i]``, the keys a query sees are always one contiguous range: ``[lo_i, hi_i)`` with
``hi_i`` the end of the span holding i (else ``i + 1``) and ``lo_i = max(0, i - w + 1)``. So a row outside every
span has the plain causal (+ window) mask, and a span's rows see ``[lo_i, end)``: the kernels that cannot take a
mask run the causal (+ window) step and then recompute just the span rows here (``attend_span_rows``).

Here: the per-sequence plan the SDPA backend uses (the first key any row needs, and the mask when a plain causal
call cannot express it), the key range read through a block table, the span rows' recomputation, and the packed
key slots of a windowed varlen call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.engine.kernels import kv_quant
from workers.engine.kernels.attention import AttentionMetadata

Span = tuple[int, int]


def first_visible_key(context: int, window: int) -> int:
    """The earliest key the first new token (at position ``context``) may see: every later row's window starts later,
    and spans never reach back past a row's window (the window is ANDed last)."""
    return max(0, context - window + 1) if window > 0 else 0


def step_spans(spans: Sequence[Span], context: int, seq_len: int) -> list[Span]:
    """The spans that change some new row's mask: those with a new row that is not their last token (the last one
    sees no later key; a decode row ending its image is causal)."""
    return [(s, min(e, seq_len)) for s, e in spans if max(s, context) < min(e, seq_len) - 1]


def sequence_spans(meta: AttentionMetadata, bidirectional: bool) -> list[list[Span]]:
    """Per sequence, the spans that matter this step on a layer with this ``bidirectional`` flag."""
    if not bidirectional or meta.bidir_spans is None:
        return [[] for _ in meta.seq_lens_cpu]
    return [
        step_spans(spans, s_len - q_len, s_len)
        for spans, q_len, s_len in zip(meta.bidir_spans, meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
    ]


def any_spans(meta: AttentionMetadata, bidirectional: bool) -> bool:
    return any(sequence_spans(meta, bidirectional))


def window_mask(
    context: int, seq_len: int, first_key: int, window: int, spans: Sequence[Span], device: torch.device
) -> Tensor:
    """Boolean [seq_len - context, seq_len - first_key]: may new row r (position context + r) see key first_key + c.
    Built as transformers composes it, AND(window, OR(causal, same span))."""
    q_pos = torch.arange(context, seq_len, device=device)[:, None]
    k_pos = torch.arange(first_key, seq_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    for start, end in spans:
        allowed |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    if window > 0:
        allowed &= k_pos > q_pos - window
    return allowed


@dataclass(frozen=True)
class SequencePlan:
    """How SDPA attends one sequence: over keys ``first_key..seq_len`` with ``mask`` (None: ``is_causal``, aligned
    top-left, which is bottom-right too when there are as many keys as queries; or no mask at all)."""

    first_key: int
    mask: Tensor | None
    is_causal: bool


def sequence_plan(
    query_len: int, seq_len: int, window: int, spans: Sequence[Span], device: torch.device
) -> SequencePlan:
    """The cheapest SDPA call for one sequence. A plain causal sequence keeps the fast ``is_causal`` path; a decode
    row's window is the key range alone; anything else gets the boolean mask."""
    context = seq_len - query_len
    first = first_visible_key(context, window)
    keys = seq_len - first
    # The window cuts some row's keys when the last row cannot see the first key kept.
    cut = window > 0 and seq_len - 1 - window >= first
    if spans or cut:
        return SequencePlan(first, window_mask(context, seq_len, first, window, spans, device), False)
    if query_len == 1:
        return SequencePlan(first, None, False)
    if query_len == keys:
        return SequencePlan(first, None, True)
    return SequencePlan(first, window_mask(context, seq_len, first, 0, (), device), False)


def gather_key_range(
    kv_cache: Tensor, block_table: Tensor, first: int, end: int, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """Keys and values ``first..end`` of one sequence, [end - first, Hkv, D], reading only the blocks they sit in;
    in ``dtype`` if given (an FP8 cache's values dequantized with its scales)."""
    block_size = kv_cache.shape[2]
    first_block = first // block_size
    blocks = block_table[first_block : -(-end // block_size)].long()
    offset = first_block * block_size
    kv = kv_cache[:, blocks].flatten(1, 2)[:, first - offset : end - offset]
    if dtype is not None:
        kv = kv_quant.dequantize_kv(kv, kv_cache, dtype)
    return kv[0], kv[1]


def attend_span_rows(
    out: Tensor, q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float, window: int,
    spans: list[list[Span]],
) -> Tensor:
    """Recompute, in place in ``out``, the rows of ``q`` inside an image span (``spans`` from ``sequence_spans``):
    row i sees keys ``[max(0, i - window + 1), end)``. ``out`` holds the causal (+ window) result for every other row,
    which is already right. Each span is one SDPA call of its new rows over its key range, with a band mask only when
    the window cuts some row's keys."""
    starts = [0]
    for q_len in meta.query_lens_cpu:
        starts.append(starts[-1] + q_len)
    gqa = q.shape[1] != kv_cache.shape[-2]
    for b, seq_spans in enumerate(spans):
        s_len = meta.seq_lens_cpu[b]
        context = s_len - meta.query_lens_cpu[b]
        for start, end in seq_spans:
            r0 = max(start, context)  # the span's first new row (its earlier tokens are cached)
            first = first_visible_key(r0, window)
            k_b, v_b = gather_key_range(kv_cache, meta.block_tables[b], first, end, q.dtype)
            mask = None
            if window > 0 and end - 1 - window >= first:  # a later row's window starts after `first`
                q_pos = torch.arange(r0, end, device=q.device)[:, None]
                mask = torch.arange(first, end, device=q.device)[None, :] > q_pos - window
            rows = slice(starts[b] + r0 - context, starts[b] + end - context)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), k_b.transpose(0, 1), v_b.transpose(0, 1),
                attn_mask=mask, scale=scale, enable_gqa=gqa,
            )
            out[rows] = o.transpose(0, 1)
    return out


def windowed_packed_kv_slots(meta: AttentionMetadata, block_size: int, window: int) -> tuple[Tensor, Tensor, int]:
    """For a varlen call on a sliding layer: the cache slot of each packed key row (every sequence's keys from its
    first visible one, ``first_visible_key``), the int32 cu_seqlens over them and the longest sequence's key count.
    The kernel aligns its causal window bottom-right, so dropping keys at the front keeps each row's positions."""
    device = meta.seq_lens.device
    firsts = [first_visible_key(s - q, window) for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)]
    counts = [s - f for s, f in zip(meta.seq_lens_cpu, firsts, strict=True)]
    total = sum(counts)
    count_t = torch.tensor(counts, dtype=torch.long, device=device)
    cu = F.pad(count_t.cumsum(0), (1, 0))
    seq_of = torch.repeat_interleave(torch.arange(len(counts), device=device), count_t, output_size=total)
    first_t = torch.tensor(firsts, dtype=torch.long, device=device)
    pos = torch.arange(total, device=device) - cu[seq_of] + first_t[seq_of]
    block = meta.block_tables.long()[seq_of, pos // block_size]
    return block * block_size + pos % block_size, cu.to(torch.int32), max(counts)
