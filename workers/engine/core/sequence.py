"""A sequence as the scheduling core sees it, and how an n > 1 request forks into its choices."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import blake3
import msgspec

from ipc.logprob_messages import SampleLogprobs
from ipc.prompts import MMItem, SamplingParams
from ipc.steps import Fork
from workers.engine.core.kv_cache import BlockAllocator

FinishReason = Literal["stop", "length", "abort", "error"]


class RequestRejected(ValueError):
    """The request can never be served with this configuration (too long for the context or the KV cache)."""


def child_rid(request_id: str, index: int) -> str:
    """The sequence id of choice ``index`` (choice 0 is the request itself)."""
    return request_id if index == 0 else f"{request_id}/{index}"


@dataclass(eq=False)
class Sequence:
    rid: str
    input_ids: list[int]
    mrope_delta: int
    items: list[MMItem]
    sampling: SamplingParams
    arrival: int
    mm_key: bytes = b""
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the cache
    # Asynchronous scheduling plans a step while the one before it runs: positions up to ``num_scheduled`` are in
    # a step sent (computed or not), and ``in_flight`` tokens are being sampled. Both equal the settled state
    # (num_computed, 0) whenever no step is in flight.
    num_scheduled: int = 0
    in_flight: int = 0
    block_table: list[int] = field(default_factory=list)
    sent_blocks: int = 0  # prefix of block_table the worker knows
    sent_tokens: int = 0  # prefix of all tokens the worker knows
    announced: bool = False
    finish_reason: FinishReason | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # prefix keys of full blocks, computed lazily
    registered: int = 0  # leading blocks published to the prefix cache
    request_id: str = ""  # the request it answers (its own rid, or its parent's for choices 1..n-1)
    index: int = 0  # its choice
    fork_blocks: list[int] = field(default_factory=list)  # n > 1, not forked yet: copies of the partial block
    forked: bool = False  # n > 1: its choices exist
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    pending: set[bytes] = field(default_factory=set)  # images whose pixels are still being written (overlap)
    state_slot: int = -1  # hybrid models: its live slot in the linear-attention state pool
    fork_slots: list[int] = field(default_factory=list)  # n > 1 on a hybrid model, not forked yet: its choices' slots
    # Families with sliding-window layers (window_blocks.py): the sliding layers' blocks, entry i for block i or -1
    # once released; the prefix the worker knows; n > 1, not forked yet: copies of the partial block in that pool.
    window_table: list[int] = field(default_factory=list)
    sent_window_blocks: int = 0
    window_fork_blocks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.request_id = self.request_id or self.rid

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def total_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def wants_fork(self) -> bool:
        return self.sampling.n > 1 and not self.forked

    def all_token_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def tokens_since(self, start: int) -> list[int]:
        """Tokens from position ``start`` on (without copying the prompt when ``start`` is past it)."""
        if start >= self.prompt_len:
            return self.output_ids[start - self.prompt_len :]
        return self.all_token_ids()[start:]

    @property
    def planned_len(self) -> int:
        """Its length once the tokens being sampled are in."""
        return self.total_len + self.in_flight

    def computable(self) -> int:
        """How far the sequence may be scheduled now: to its end (counting a token still being sampled, whose id
        the worker takes from its own samples), or to the first image still being written that is not scheduled
        yet (a chunk stops short of it; never below what is scheduled already). While any image is still being
        written, the prompt's last token waits too, even when the prefix cache holds the images' span: no token
        may be sampled before the request's last image is reported (the frontend learns of the request then)."""
        if not self.pending:
            return self.planned_len
        ends = [it.offset for it in self.items if it.hash in self.pending and it.offset + it.length > self.num_scheduled]
        return max(self.num_scheduled, min(ends, default=self.planned_len - 1))

    def ends_in_flight(self, max_model_len: int) -> bool:
        """Whether the token being sampled is its last (max_tokens or the context length): nothing to plan."""
        if not self.in_flight:
            return False
        return len(self.output_ids) + self.in_flight >= self.sampling.max_tokens or self.planned_len >= max_model_len


@dataclass(frozen=True)
class SeqUpdate:
    rid: str
    token_id: int | None  # None: the request ended without a token (max_tokens 0: its prompt alone)
    finish_reason: FinishReason | None
    logprobs: SampleLogprobs | None = None
    request_id: str = ""
    index: int = 0
    cached_tokens: int = 0


def check_prompt(input_ids: list[int], n: int, max_model_len: int, allocator: BlockAllocator) -> None:
    """Refuse a prompt this configuration can never serve: empty, too long for the context or the KV cache."""
    if len(input_ids) == 0:
        raise RequestRejected("the prompt is empty")
    if len(input_ids) >= max_model_len:
        raise RequestRejected(f"the prompt has {len(input_ids)} tokens, but the context length is {max_model_len}")
    need = allocator.blocks_for(len(input_ids) + 1) + fork_blocks_needed(len(input_ids), n, allocator.block_size)
    if need > allocator.num_blocks:
        raise RequestRejected(f"the prompt needs {need} KV blocks, the cache has {allocator.num_blocks} in all")


def prompt_only_updates(seq: Sequence) -> list[SeqUpdate]:
    """max_tokens 0 (completions' echo): the prompt was computed (for its log probabilities) and the request
    ends with no token; with n > 1 every choice ends alike (none was forked: nothing was sampled)."""
    indices = [seq.index] if seq.sampling.n == 1 else list(range(seq.sampling.n))
    return [
        SeqUpdate(child_rid(seq.request_id, i), None, "length", None, seq.request_id, i, seq.cached_tokens)
        for i in indices
    ]


def combined_mm_key(items: list[MMItem]) -> bytes:
    """Baseline mode's cache key: one hash over all of a request's image hashes, in order."""
    h = blake3.blake3(b"glimpse-request-mm")
    for item in items:
        h.update(item.hash)
    return h.digest(16)


def fork_blocks_needed(prompt_len: int, n: int, block_size: int) -> int:
    """Blocks an n > 1 request needs beyond its own: one copy of a partial last prompt block per extra choice
    (a full block is shared as it is; the first decode of each choice then takes a block of its own)."""
    return (n - 1) if n > 1 and prompt_len % block_size else 0


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: the request's plus the index (vLLM's offset), wrapped to stay a 64-bit seed (torch's
    range, and what the IPC messages carry): a seed near 2**64 - 1 would otherwise overflow for choices past 0."""
    out = seed + index
    return out - 2**64 if out > 2**64 - 1 else out


def fork(
    parent: Sequence, allocator: BlockAllocator, arrival: int, window: BlockAllocator | None = None
) -> list[tuple[Sequence, Fork]]:
    """Choices 1..n-1 of ``parent``, whose prompt the step being planned completes. Each shares the
    parent's full prompt blocks (one more reference each) and takes one of the reserved copies of the
    partial block; it starts as computed up to the prompt's end and samples from the parent's logits.
    ``window``: the sliding layers' allocator, whose blocks are shared and copied alike (released ones stay -1)."""
    bs = allocator.block_size
    full = parent.prompt_len // bs
    shared = parent.block_table[:full]
    partial = parent.block_table[full] if parent.prompt_len % bs else None
    window_shared = parent.window_table[:full]
    window_partial = parent.window_table[full] if window is not None and partial is not None else None
    out = []
    for index in range(1, parent.sampling.n):
        seed = None if parent.sampling.seed is None else choice_seed(parent.sampling.seed, index)
        sampling = msgspec.structs.replace(parent.sampling, n=1, seed=seed)
        allocator.share(shared)
        table = list(shared)
        copy = None
        if partial is not None:
            table.append(parent.fork_blocks.pop())
            copy = (partial, table[-1])
        child = Sequence(
            child_rid(parent.request_id, index),
            parent.input_ids,  # shared: a prompt is never mutated
            parent.mrope_delta,
            parent.items,
            sampling,
            arrival,
            mm_key=parent.mm_key,
            num_computed=parent.prompt_len,
            num_scheduled=parent.prompt_len,
            in_flight=1,  # its first token is sampled from the parent's logits in the step being planned
            block_table=table,
            sent_blocks=len(table),
            sent_tokens=parent.prompt_len,
            announced=True,
            registered=full,  # the parent publishes the shared blocks; the copy is published once full
            request_id=parent.request_id,
            index=index,
            cached_tokens=parent.cached_tokens,
        )
        child.state_slot = parent.fork_slots.pop() if parent.fork_slots else -1
        window_copy = None
        if window is not None:
            window.share([b for b in window_shared if b >= 0])
            child.window_table = list(window_shared)
            if window_partial is not None:
                child.window_table.append(parent.window_fork_blocks.pop())
                window_copy = (window_partial, child.window_table[-1])
            child.sent_window_blocks = len(child.window_table)
        out.append((child, Fork(
            parent.rid, child.rid, index, table, copy, seed, child.state_slot, list(child.window_table), window_copy,
        )))  # fmt: skip
    parent.forked = True
    return out
