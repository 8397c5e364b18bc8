"""Paged-KV attention's interface: one metadata layout, and the backend protocol every implementation follows.

A forward step covers the *new* tokens of B sequences, flattened one sequence after another.
New token i of sequence b sits at absolute position ``context_len_b + i`` (context_len_b =
seq_lens[b] - query_lens[b]) and attends causally to KV positions ``[0, context_len_b + i]``,
i.e. the causal mask is aligned to the bottom-right of the [query_len, seq_len] score matrix.

KV cache of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V).
Slot ``s`` is ``(block_id, offset) = divmod(s, block_size)``. Its dtype is the model's, or e4m3 with per-head scales
(``--kv-cache-dtype fp8``, kv_quant.py): the write quantizes, every backend's read dequantizes.

Here: the metadata, how it is built and what backends derive from it (the leading decodes, the metadata of the
rest, packed-KV slots), the ``AttentionBackend`` protocol and the small helpers every backend shares. The
backends on torch's kernels are in torch_attention.py, FlashAttention-3 in fa3_attention.py, and the registry
that picks one in backends.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.engine.kernels.kv_write_kernel import write_kv_cache

log = logging.getLogger(__name__)


@dataclass
class StateMetadata:
    """The recurrent state of a hybrid model's linear-attention layers for one forward; row b is sequence b of the
    AttentionMetadata it rides on.

    Every linear-attention layer keeps a pool of per-sequence states (a conv window and a recurrent matrix per
    value head), indexed by slot. A sequence reads its slot's state before its new tokens (or zeros where
    ``has_initial`` is False: its first chunk at position 0) and leaves its state after them in the same slot.
    ``snapshots`` asks for copies of the state part-way through a chunk (prefix caching at block boundaries)."""

    slots: Tensor  # int64 [B] on the model device: each sequence's live slot in the layers' state pools
    slots_cpu: list[int]
    has_initial: Tensor  # bool [B] on the model device
    has_initial_cpu: list[bool]
    # (sequence b, n, slot): once sequence b has taken its first n new tokens of this step (1 <= n <= its query
    # length), copy its state (conv window and recurrent matrix) into pool slot ``slot``.
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)

    def initial(self, pool: Tensor) -> Tensor:
        """Every sequence's state in ``pool`` before its new tokens ([B, ...], the pool's dtype); zeros where it has
        none. ``where`` rather than a multiply: a slot without initial state may hold NaN or inf from an earlier
        owner."""
        got = pool.index_select(0, self.slots)
        keep = self.has_initial.view(-1, *([1] * (pool.dim() - 1)))
        return torch.where(keep, got, torch.zeros((), dtype=got.dtype, device=got.device))


@dataclass
class AttentionMetadata:
    """One forward over a flattened batch: the new tokens of B sequences, one sequence after another."""

    query_start_loc: Tensor  # int32 [B+1], cu_seqlens of new tokens, on model device
    seq_lens: Tensor  # int32 [B], KV length of each sequence AFTER this step (cached context + new tokens)
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    slot_mapping: Tensor  # int64 [T], slot (block_id * block_size + offset) receiving each new token's K/V
    block_tables: Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    max_query_len: int
    max_seq_len: int
    # The new tokens' K/V are in the cache already (piecewise graphs write them inside a captured piece, a decode
    # layer's rotary kernel writes them: rope_kernel.cache_slots): the backend only attends.
    kv_written: bool = False
    # Hybrid models: the linear-attention layers' per-sequence state (None for pure-attention models).
    state: StateMetadata | None = None
    # Families whose image tokens attend to each other both ways (ModelSpec.bidirectional_images): per sequence,
    # the absolute [start, end) positions of the images whose spans overlap this step's new tokens. A span is
    # never cut by a step (the scheduler's rule), so every key a span's query needs is cached or new this step.
    # None: every layer is causal.
    bidir_spans: list[list[tuple[int, int]]] | None = None
    # Families with sliding-window layers whose caches have a block pool of their own (ModelSpec.kv_windows): the
    # same step seen through those caches' block tables and slots (same query and sequence lengths, bidir spans);
    # the sliding layers attend with it. None: every layer uses this metadata.
    window: AttentionMetadata | None = None
    # Values a backend derives from the fields above. They are the same for every layer, so the first
    # layer computes them and the other layers reuse them (28x fewer index kernels per step on a 7B).
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # ``written``'s view of this step, made by the first layer that asks (not copied by ``replace``).
    _written: AttentionMetadata | None = field(default=None, init=False, repr=False, compare=False)

    def written(self) -> AttentionMetadata:
        """This step with ``kv_written`` set and the same derived values: what a backend is handed by a layer that
        has put its K/V into the cache already. One per step, shared by every layer."""
        if self._written is None:
            self._written = replace(self, kv_written=True)
        return self._written


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build metadata from host-side lists (block_tables[b] lists sequence b's physical blocks in order)."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    slots: list[int] = []
    for q_len, s_len, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
        if not 0 < q_len <= s_len or len(blocks) * block_size < s_len:
            raise ValueError(f"bad sequence: query_len={q_len} seq_len={s_len} blocks={len(blocks)}")
        for pos in range(s_len - q_len, s_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    width = max(len(b) for b in block_tables)
    table = [list(b) + [0] * (width - len(b)) for b in block_tables]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(table, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def write_new_kv(k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> None:
    """The step's new K/V into their cache slots, unless a piecewise graph already wrote them (``kv_written``)."""
    if not meta.kv_written:
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)


class AttentionBackend(Protocol):
    name: str
    # Whether ``forward`` skips its K/V write for a ``meta.kv_written`` step (rope_kernel.cache_slots relies on it).
    honours_kv_written: bool

    def forward(
        self, q: Tensor, k: Tensor | None, v: Tensor | None, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
        window: int = 0, bidirectional: bool = False,
    ) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens; writes k, v into kv_cache at
        meta.slot_mapping, then returns attention output [T, Hq, D] over the cached prefix + new
        tokens (GQA: Hq is a multiple of Hkv).

        k = v = None: the new tokens' K/V are already in ``kv_cache`` (a layer reading another layer's cache,
        Gemma 4's KV sharing): attend only. ``window`` > 0: a sliding-window layer, the query at position i sees
        keys j with i - window < j (transformers' ``sliding_window_overlay``). ``bidirectional``: inside each span
        of ``meta.bidir_spans`` every query also sees the span's later keys (causal OR same-image, then AND the
        window, as transformers' Gemma 4 masks compose)."""
        ...


def gather_sequence_kv(kv_cache: Tensor, block_table: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """Return one sequence's K, V as contiguous ``[seq_len, Hkv, D]`` read through its block table."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-seq_len // block_size)].long()
    kv = kv_cache[:, blocks].flatten(1, 2)[:, :seq_len]  # [2, seq_len, Hkv, D]
    return kv[0], kv[1]


def bottom_right_causal_mask(query_len: int, seq_len: int, device: torch.device) -> Tensor:
    """Boolean [query_len, seq_len] mask, True where query i may attend key j (j <= context + i)."""
    context = seq_len - query_len
    q_pos = torch.arange(context, seq_len, device=device).unsqueeze(1)
    return torch.arange(seq_len, device=device).unsqueeze(0) <= q_pos


def decode_prefix(meta: AttentionMetadata) -> int:
    """How many leading sequences of the step have exactly one new token."""
    count = 0
    for query_len in meta.query_lens_cpu:
        if query_len != 1:
            break
        count += 1
    return count


def tail_metadata(meta: AttentionMetadata, first: int) -> AttentionMetadata:
    """The metadata of sequences ``first..`` alone (their rows start at row ``first``: one per sequence before)."""
    query_lens, seq_lens = meta.query_lens_cpu[first:], meta.seq_lens_cpu[first:]
    return AttentionMetadata(
        query_start_loc=meta.query_start_loc[first:] - first,
        seq_lens=meta.seq_lens[first:],
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        slot_mapping=meta.slot_mapping[first:],
        block_tables=meta.block_tables[first:],
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        bidir_spans=meta.bidir_spans[first:] if meta.bidir_spans is not None else None,
    )


def sequence_of_rows(query_start_loc: Tensor, rows: int) -> Tensor:
    """The sequence index of each of a step's ``rows`` new-token rows (int64, on the device; no host sync)."""
    lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    return torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=rows)


def packed_kv_slots(meta: AttentionMetadata, block_size: int) -> tuple[Tensor, Tensor]:
    """Cache slot of each row of the sequences' packed KV, and the int32 cu_seqlens over them."""
    device = meta.seq_lens.device
    total = sum(meta.seq_lens_cpu)
    seq_lens = meta.seq_lens.long()
    cu = F.pad(seq_lens.cumsum(0), (1, 0))
    seq_of = torch.repeat_interleave(
        torch.arange(len(meta.seq_lens_cpu), device=device), seq_lens, output_size=total
    )
    pos = torch.arange(total, device=device) - cu[seq_of]
    block = meta.block_tables.long()[seq_of, pos // block_size]
    return block * block_size + pos % block_size, cu.to(torch.int32)
