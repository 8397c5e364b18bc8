"""The host side of one model step on a worker: its sequences as the worker knows them, the flat inputs a plan's
chunks make (token ids, M-RoPE positions, KV slots, block tables, image splices, sampled rows), and the queued step
whose sampled ids come back later (`Launched`, for asynchronous scheduling)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ipc.prompts import MMItem, SamplingParams
from ipc.steps import Fork, StepPlan, StepResult
from workers.engine.core.kv_cache import slot_mapping
from workers.engine.models.model_spec import ModelSpec
from workers.engine.runner.batching import host_tensor, to_device
from workers.engine.runner.prompt_logprobs import PromptSpan, ScoredPrompts, span_for
from workers.engine.runner.sampler import LogprobRows


@dataclass
class WorkerSeq:
    rid: str
    token_ids: list[int]
    positions: list[list[int]]  # M-RoPE positions of the tokens known at registration; later: p + mrope_delta
    mrope_delta: int
    items: list[MMItem]
    sampling: SamplingParams
    mm_key: bytes
    item_rows: list[int]  # baseline mode: row offset of each item inside the request's entry
    block_table: list[int] = field(default_factory=list)
    prompt_until: int = 0  # prompt_logprobs: positions below this are scored (see prompt_logprobs.py)
    state_slot: int = -1  # hybrid models: its live slot in the linear-attention state pools
    # Sliding-window layers' own pool: the sequence's window table (released entries point at the scratch block) and
    # how many leading entries are known released.
    window_table: list[int] = field(default_factory=list)
    window_released: int = 0


@dataclass
class Launched:
    """A step whose GPU work is queued: its sampled ids reach the host (and the StepResult is made) in `result`,
    which a worker calls once `done`, after it has queued the next step."""

    step_id: int
    images_encoded: int
    vit_calls: int
    rids: list[str] = field(default_factory=list)
    tokens: torch.Tensor | None = None  # int64 [len(rids)]: pinned host memory on CUDA, filled by a queued copy
    logprobs: LogprobRows | None = None  # read with the ids, so they too need not hold up the next step
    scored: ScoredPrompts | None = None  # the same for prompt log probabilities
    event: torch.cuda.Event | None = None  # recorded after the copy; None: finished already (CPU)

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def result(self) -> StepResult:
        if self.event is not None:
            self.event.synchronize()
        ids = self.tokens.tolist() if self.tokens is not None else []
        sampled = list(zip(self.rids, ids, strict=True))
        logprobs = self.logprobs.entries() if self.logprobs is not None else []
        scored = self.scored.entries() if self.scored is not None else []
        return StepResult(self.step_id, sampled, self.images_encoded, self.vit_calls, logprobs, scored)


@dataclass
class StepInputs:
    ids: list[int] = field(default_factory=list)
    positions: list[list[int]] = field(default_factory=lambda: [[], [], []])
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_seqs: list[WorkerSeq] = field(default_factory=list)
    splices: list[tuple[int, bytes, int, int]] = field(default_factory=list)  # (row in batch, key, first entry row, count)
    spans: list[PromptSpan] = field(default_factory=list)  # rows whose prompt logprobs were asked for
    ahead: list[tuple[int, str]] = field(default_factory=list)  # (row, sequence): its id is being sampled (see below)
    # Hybrid models, per sequence: its state slot, whether it has state before this chunk (a chunk at position 0 starts
    # from zeros), and the snapshots of the step as StateMetadata takes them: (sequence, tokens into its chunk, slot).
    state_slots: list[int] = field(default_factory=list)
    has_initial: list[bool] = field(default_factory=list)
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    # Families whose image tokens attend both ways (ModelSpec.bidirectional_images): per sequence, the absolute
    # [start, end) spans of its images that overlap this step's chunk (AttentionMetadata.bidir_spans). None: causal.
    bidir_spans: list[list[tuple[int, int]]] | None = None
    # A window pool (ModelSpec.kv_windows): the new tokens' slots there and each sequence's window table.
    window_slots: list[int] = field(default_factory=list)
    window_tables: list[list[int]] = field(default_factory=list)


ForkFn = Callable[[WorkerSeq, list[Fork]], list[WorkerSeq]]


def gather_inputs(
    plan: StepPlan, seqs: dict[str, WorkerSeq], block_size: int, spec: ModelSpec, fork: ForkFn, window_blocks: int = 0
) -> StepInputs:
    """The step's flat inputs, its sequences' block tables and tokens brought up to date from the plan.
    ``window_blocks``: the size of the sliding layers' own pool (0: none), whose block ``window_blocks`` is scratch.

    A chunk that starts right past the tokens this worker was sent computes a token the step before is still
    sampling (asynchronous scheduling planned it before the id was known): its row goes to ``ahead`` with a
    placeholder id, which `ahead_token_ids` replaces on the device."""
    out = StepInputs(bidir_spans=[] if spec.bidirectional_images else None)
    ids, pos = out.ids, out.positions
    snapshots: dict[str, list[tuple[int, int]]] = {}
    for rid, position, slot in plan.snapshots:
        snapshots.setdefault(rid, []).append((position, slot))
    for chunk in plan.chunks:
        seq = seqs[chunk.rid]
        seq.block_table.extend(chunk.new_blocks)
        seq.token_ids.extend(chunk.new_token_ids)
        start, end = chunk.start, chunk.start + chunk.length
        base = len(ids)
        if end <= len(seq.token_ids):
            ids.extend(seq.token_ids[start:end])
        elif start == len(seq.token_ids) and chunk.length == 1:
            out.ahead.append((base, chunk.rid))
            ids.append(0)
        else:
            raise RuntimeError(f"step {plan.step_id} computes {chunk.rid} past the tokens it was sent")
        # The prompt's M-RoPE rows as sliced, then each generated token's position plus the delta (slices: a
        # 4,096-token chunk's three rows took ~1 ms of host time a step through a per-token generator).
        split = min(max(start, len(seq.positions[0])), end)
        generated = range(split + seq.mrope_delta, end + seq.mrope_delta)
        for r in range(3):
            pos[r].extend(seq.positions[r][start:split])
            pos[r].extend(generated)
        out.slots.extend(slot_mapping(seq.block_table, start, chunk.length, block_size))
        out.query_lens.append(chunk.length)
        out.seq_lens.append(end)
        out.tables.append(seq.block_table)
        if window_blocks:
            _window_inputs(out, seq, chunk.new_window_blocks, start, chunk.length, block_size, spec.window, window_blocks)
        if seq.state_slot >= 0:
            b = len(out.state_slots)
            out.state_slots.append(seq.state_slot)
            out.has_initial.append(start > 0)
            out.snapshots.extend((b, position - start, slot) for position, slot in snapshots.get(chunk.rid, ()))
        if out.bidir_spans is not None:
            out.bidir_spans.append(
                [(it.offset, it.offset + it.length) for it in seq.items if it.offset < end and start < it.offset + it.length]
            )
        for i, item in enumerate(seq.items):
            lo, hi = max(start, item.offset), min(end, item.offset + item.length)
            if lo >= hi:
                continue
            key, row0 = (seq.mm_key, seq.item_rows[i]) if seq.mm_key else (item.hash, 0)
            out.splices.append((base + lo - start, key, row0 + lo - item.offset, hi - lo))
        if (span := span_for(seq, start, end, base, spec)) is not None:
            out.spans.append(span)
        if chunk.sample:
            out.sample_rows.append(len(ids) - 1)
            out.sample_seqs.append(seq)
            for child in fork(seq, [f for f in plan.forks if f.parent == chunk.rid]):
                out.sample_rows.append(len(ids) - 1)  # a choice's first token comes from the parent's logits
                out.sample_seqs.append(child)
    # Image spans hold pad values above the vocabulary; they embed as the image token (its row is replaced by the
    # image's features in the forward; Gemma 4's embedding reads the pad token's per-layer inputs there, as
    # transformers does for its placeholders).
    top = spec.vocab_size - 1
    image_id = spec.image_token_id if spec.image_token_id <= top else top
    out.ids = [i if i <= top else image_id for i in ids]
    return out


def _window_inputs(
    out: StepInputs, seq: WorkerSeq, new: list[int], start: int, length: int, block_size: int, window: int, scratch: int
) -> None:
    """A chunk's slots and table in the window pool. -1 entries (before a prefix hit's window) and the entries the
    scheduler released by the same rule as here (window_blocks.py: wholly before the chunk's first query's window,
    maybe handed to another sequence since) point at the scratch block, which the window mask never lets a query
    see: the kernels may read it, never use it."""
    table = seq.window_table
    table.extend(b if b >= 0 else scratch for b in new)
    dead = min(len(table), max(0, start - window + 1) // block_size)
    for i in range(seq.window_released, dead):
        table[i] = scratch
    seq.window_released = max(seq.window_released, dead)
    out.window_slots.extend(slot_mapping(table, start, length, block_size))
    out.window_tables.append(table)


def ahead_token_ids(
    ids: list[int],
    ahead: list[tuple[int, str]],
    last: tuple[torch.Tensor, dict[str, int]] | None,
    device: torch.device,
) -> torch.Tensor:
    """The step's input ids on the device, where the ``ahead`` rows (batch row, sequence) take the id the step
    before sampled for their sequence. ``last``: that step's sampled ids on the device and each sequence's row."""
    out = to_device([host_tensor(ids)], device)
    if last is None:
        # The step before failed (the scheduler fails its requests before this step's result can reach them), so
        # these rows compute placeholders that nobody reads; the step's other sequences go on.
        return out
    sampled, row_of = last
    try:
        src = [row_of[rid] for _, rid in ahead]
    except KeyError as exc:
        raise RuntimeError(f"a step planned ahead needs a token of {exc} that the step before did not sample") from None
    index = to_device([torch.tensor([*(row for row, _ in ahead), *src], dtype=torch.int64)], device)
    dst, src_rows = index.split(len(ahead))
    return out.index_copy_(0, dst, sampled.index_select(0, src_rows))
