"""Scheduling core: continuous batching with chunked prefill, KV admission control and the
embedding-cache plan. Pure bookkeeping: it never touches tensors or pixels, so the same object
runs inside the offline ``Engine`` and inside the scheduler process.

Each step spends a token budget (``chunk_size``; ``lone_prefill_tokens`` when no sequence is decoding):
running decodes first (one token each), then prefill chunks of running sequences, then newly admitted
requests. A request is admitted only
when KV blocks for its whole prompt are free now; one that could never fit is rejected in ``add``.
A decode that needs a block when none is free preempts the newest running sequence, which is
recomputed later.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Literal

from ipc.prompts import MMItem, SamplingParams
from ipc.steps import Fork, NewSeq, SeqChunk, StepPlan, StepResult
from workers.engine.core.kv_cache import BlockAllocator, block_hashes
from workers.engine.core.mm_cache import EmbeddingCacheIndex
from workers.engine.core.sequence import (
    FinishReason,
    RequestRejected,
    Sequence,
    SeqUpdate,
    check_prompt,
    child_rid,
    combined_mm_key,
    fork,
    fork_blocks_needed,
    prompt_only_updates,
)

__all__ = ["FinishReason", "RequestRejected", "SchedulerCore", "SeqUpdate", "Sequence"]


class SchedulerCore:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        chunk_size: int,
        max_num_seqs: int,
        max_model_len: int,
        mm_cache_bytes: int,
        embedding_bytes_per_token: int,
        eos_token_ids: tuple[int, ...],
        mm_cache_mode: Literal["image", "request"] = "image",
        enable_prefix_caching: bool = True,
        lone_prefill_tokens: int = 0,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.chunk_size = chunk_size
        # Budget of a step with no decoding sequence: no one's inter-token latency depends on it, and a lone
        # prompt's prefill gets fewer, larger chunks (fewer steps, better GEMM and attention shapes).
        self.lone_prefill_tokens = max(chunk_size, lone_prefill_tokens)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.mm_cache_mode = mm_cache_mode
        self.prefix_caching = enable_prefix_caching
        self.mm_index = EmbeddingCacheIndex(mm_cache_bytes, embedding_bytes_per_token)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._step_ids = itertools.count()
        self._finished_for_workers: list[str] = []
        self._in_flight: deque[StepPlan] = deque()  # sent, result not back yet; two only with schedule(ahead=True)
        self._drain = False  # a step planned ahead lacked blocks: plan the next one from the results
        self.on_finished: Callable[[Sequence], None] | None = None  # e.g. unlink the request's shm
        # (sequence, indices of blocks it just published, its block keys): KV-cache events' BlockStored.
        self.on_blocks_stored: Callable[[Sequence, list[int], list[bytes]], None] | None = None
        self.preemptions = 0
        self.samples_dropped = 0  # sampled for a sequence that ended (or lost its KV) while the step ran
        self.images_planned = 0
        self.prompt_tokens_computed = 0
        # n > 1: the live sequences of each request; the request ends (on_finished) with its last one.
        self.families: dict[str, list[Sequence]] = {}

    # ---- requests -------------------------------------------------------------------------------
    def add(
        self,
        rid: str,
        input_ids: list[int],
        mrope_delta: int,
        items: list[MMItem],
        sampling: SamplingParams,
        more_prompts: list[list[int]] | None = None,
        pending: Iterable[bytes] = (),
    ) -> None:
        """Queue request ``rid``. ``more_prompts``: a batch of text prompts after the first (completions), prompt
        p computed as sequence child_rid(rid, p) answering choice p; like n > 1 choices, one request ends with all.
        ``pending``: hashes of images whose pixels are not written yet; prefill stops short of them until
        `media_ready` names them."""
        if rid in self.seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        if more_prompts and sampling.n > 1:
            raise ValueError("a batch of prompts takes n = 1")
        for ids in [input_ids, *(more_prompts or [])]:
            check_prompt(ids, sampling.n, self.max_model_len, self.allocator)
        seq = Sequence(rid, list(input_ids), mrope_delta, list(items), sampling, next(self._arrivals))
        seq.pending = set(pending)
        if self.mm_cache_mode == "request" and items:
            seq.mm_key = combined_mm_key(seq.items)
        # Text prompts (no images) have no M-RoPE delta.
        more = [Sequence(child_rid(rid, p), list(ids), 0, [], sampling, next(self._arrivals), request_id=rid, index=p)
                for p, ids in enumerate(more_prompts or [], 1)]
        for member in (seq, *more):
            self.seqs[member.rid] = member
        if sampling.n > 1 or more:
            self.families[rid] = [seq, *more]
        self.waiting.extend([seq, *more])

    def media_ready(self, rid: str, hashes: list[bytes]) -> None:
        if (seq := self.seqs.get(rid)) is not None:
            seq.pending.difference_update(hashes)

    def abort(self, rid: str) -> bool:
        """End request ``rid``: all its choices."""
        family = self.families.get(rid)
        seqs = list(family) if family is not None else [self.seqs[rid]] if rid in self.seqs else []
        for seq in seqs:
            self._finish(seq, "abort")
        return bool(seqs)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_for_workers)

    # ---- planning -------------------------------------------------------------------------------
    def schedule(self, ahead: bool = False) -> StepPlan | None:
        """Plan the next step, or None when there is nothing to do.

        ``ahead`` (asynchronous scheduling): plan it while the one step in flight still runs, or return None when
        it must wait for that step's result. A sequence whose token that step is sampling decodes it next: the
        worker takes its id from its own samples. One that stops on that token (EOS, a stop string) computes one
        token for nothing, which `update` drops. A step planned ahead never preempts: short of blocks, planning
        waits for the results (`schedule` then decides); and a sequence with structured outputs waits for its token
        (its grammar must see it before the next mask)."""
        if ahead:
            if len(self._in_flight) != 1 or self._drain:
                return None
        elif self._in_flight:
            raise RuntimeError("schedule() called again before update() of the previous step")
        self._drain = False
        plannable = [s for s in self.running if not s.ends_in_flight(self.max_model_len)]
        if ahead:
            plannable = [s for s in plannable if not (s.in_flight and s.sampling.structured is not None)]
        decoding = any(s.planned_len - s.num_scheduled == 1 for s in plannable)
        budget = self.chunk_size if decoding else self.lone_prefill_tokens
        picked: list[tuple[Sequence, int]] = []
        # Decodes first: they are one token each and keep latency flat.
        for seq in sorted(plannable, key=lambda s: s.planned_len - s.num_scheduled != 1):
            if budget == 0:
                break
            if seq not in self.running:  # preempted while making room for an earlier one
                continue
            length = min(seq.computable() - seq.num_scheduled, budget)
            if length <= 0:  # waiting for an image to be written, or all of it is in flight
                continue
            if not self._ensure_blocks(seq, seq.num_scheduled + length, {s for s, _ in picked}, ahead):
                continue
            picked.append((seq, length))
            budget -= length
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            extra = fork_blocks_needed(seq.prompt_len, seq.sampling.n, self.allocator.block_size) if seq.wants_fork else 0
            need = self.allocator.blocks_for(seq.total_len + 1) - len(cached) + extra
            if need > self.allocator.num_free - self.allocator.reusable_free(cached):
                break  # it fits later, once running requests free blocks; keep FCFS order
            self.waiting.pop(0)
            if cached:
                # The prompt starts with blocks another request computed: share them, skip their prefill.
                self.allocator.acquire(cached)
                seq.block_table = list(cached)
                seq.registered = len(cached)
                seq.num_computed = seq.num_scheduled = len(cached) * self.allocator.block_size
                if not seq.output_ids:  # a first admission, not the recompute after a preemption
                    seq.cached_tokens = seq.num_computed
            seq.block_table.extend(self.allocator.allocate(need - extra))
            seq.fork_blocks = self.allocator.allocate(extra)
            self.running.append(seq)
            length = min(seq.computable() - seq.num_scheduled, budget)
            if length > 0:  # else admitted (its blocks are reserved) but waiting for an image to be written
                picked.append((seq, length))
                budget -= length
        if not picked and (ahead or not self._finished_for_workers):
            return None  # (a step planned ahead for the finished alone is not worth it: the next plan takes them)
        plan = self._build_plan(picked, ahead)
        self._in_flight.append(plan)
        return plan

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        if not self.prefix_caching or seq.sampling.prompt_logprobs is not None:  # it must compute every position
            return []
        bs = self.allocator.block_size
        # Leave at least the last token to compute: its logits give the first sampled token.
        limit = (seq.total_len - 1) // bs
        return self.allocator.match(block_hashes(seq.all_token_ids(), bs, limit, seq.block_hashes, seq.items))

    def _register_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full blocks to the prefix cache."""
        bs = self.allocator.block_size
        full = min(seq.num_computed // bs, len(seq.block_table))
        if not self.prefix_caching or full <= seq.registered:
            return
        hashes = block_hashes(seq.all_token_ids(), bs, full, seq.block_hashes, seq.items)
        stored = [i for i in range(seq.registered, full) if self.allocator.register(seq.block_table[i], hashes[i])]
        seq.registered = full
        if stored and self.on_blocks_stored is not None:
            self.on_blocks_stored(seq, stored, hashes)

    def _ensure_blocks(self, seq: Sequence, num_tokens: int, picked: set[Sequence], ahead: bool = False) -> bool:
        need = self.allocator.blocks_for(num_tokens) - len(seq.block_table)
        if ahead and need > 0 and not self.allocator.can_allocate(need):
            # A step in flight may still write the victim's blocks, and its result would land on a sequence that
            # lost its KV: no preemption now. The next plan waits for the results and preempts if it must.
            self._drain = True
            return False
        while need > 0 and not self.allocator.can_allocate(need):
            # The newest sequence not already in this step loses its KV (it alone, if nothing else is left).
            victim = max((s for s in self.running if s not in picked), key=lambda s: s.arrival)
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's KV and queue it for recompute (prompt + tokens so far)."""
        self.preemptions += 1
        self.running.remove(seq)
        self.allocator.free(seq.block_table + seq.fork_blocks)
        seq.block_table, seq.fork_blocks = [], []
        seq.num_computed = seq.num_scheduled = seq.registered = seq.in_flight = 0
        if seq.announced:
            self._finished_for_workers.append(seq.rid)
        seq.announced = False
        seq.sent_blocks = seq.sent_tokens = 0
        self.waiting.insert(0, seq)

    def _build_plan(self, picked: list[tuple[Sequence, int]], ahead: bool = False) -> StepPlan:
        new_seqs: list[NewSeq] = []
        chunks: list[SeqChunk] = []
        needed: dict[bytes, list[MMItem]] = {}  # key -> items to encode under it, in first-seen order
        forks: list[Fork] = []
        for seq, length in picked:
            if not seq.announced:
                new_seqs.append(self._announce(seq))
            start = seq.num_scheduled
            new_tokens = seq.tokens_since(seq.sent_tokens)
            seq.sent_tokens = seq.total_len
            seq.num_scheduled = start + length
            chunks.append(
                SeqChunk(
                    rid=seq.rid,
                    start=start,
                    length=length,
                    new_blocks=seq.block_table[seq.sent_blocks :],
                    new_token_ids=new_tokens,
                    sample=start + length == seq.planned_len and seq.sampling.max_tokens > 0,
                )
            )
            seq.in_flight += chunks[-1].sample
            seq.sent_blocks = len(seq.block_table)
            self.prompt_tokens_computed += max(0, min(start + length, seq.prompt_len) - start)
            for key, items in self._keys_for_chunk(seq, start, start + length):
                needed.setdefault(key, items)
            if chunks[-1].sample and seq.wants_fork:
                forks.extend(self._fork(seq))
        evict, encode = self.mm_index.plan(needed)
        self.images_planned += sum(len(job.items) for job in encode)
        finished, self._finished_for_workers = self._finished_for_workers, []
        return StepPlan(next(self._step_ids), new_seqs, chunks, evict, encode, finished, forks=forks, ahead=ahead)

    def _fork(self, parent: Sequence) -> list[Fork]:
        out = []
        for child, spec in fork(parent, self.allocator, next(self._arrivals)):
            self.seqs[child.rid] = child
            self.running.append(child)
            self.families[parent.request_id].append(child)
            out.append(spec)
        return out

    def _announce(self, seq: Sequence) -> NewSeq:
        seq.announced = True
        seq.sent_tokens = seq.total_len  # NewSeq carries every token so far
        # Items without their shm pointers: a worker needs a pointer only in the step that encodes the image,
        # and there the EncodeItem carries it, so each pointer crosses the link once per encode.
        items = [MMItem(it.hash, it.offset, it.length, it.grid, frame=it.frame) for it in seq.items]
        return NewSeq(
            seq.rid, seq.all_token_ids(), seq.mrope_delta, items, seq.sampling, seq.mm_key, len(seq.output_ids)
        )

    def _keys_for_chunk(self, seq: Sequence, start: int, end: int) -> list[tuple[bytes, list[MMItem]]]:
        """Embedding-cache keys the chunk [start, end) reads: only images whose span overlaps it."""
        overlapping = [it for it in seq.items if it.offset < end and it.offset + it.length > start]
        if self.mm_cache_mode == "request":
            # Baseline: one entry for all the request's images, encoded with the first chunk.
            if seq.items and (start == 0 or overlapping):
                return [(seq.mm_key, seq.items)]
            return []
        return [(it.hash, [it]) for it in overlapping]

    # ---- results --------------------------------------------------------------------------------
    def update(self, result: StepResult) -> list[SeqUpdate]:
        if not self._in_flight or self._in_flight[0].step_id != result.step_id:
            raise RuntimeError(f"result for step {result.step_id} does not match the step in flight")
        plan = self._in_flight.popleft()  # results come back in the order the steps were sent
        prompt_only: list[Sequence] = []  # max_tokens 0: the prompt was all there was to compute
        for chunk in plan.chunks:
            seq = self.seqs.get(chunk.rid)
            if seq is not None and seq.finish_reason is None and seq.announced:
                seq.num_computed = chunk.start + chunk.length
                self._register_blocks(seq)
                if seq.sampling.max_tokens == 0 and seq.num_computed >= seq.prompt_len:
                    prompt_only.append(seq)
        updates: list[SeqUpdate] = []
        for seq in prompt_only:
            self._finish(seq, "length")
            updates.extend(prompt_only_updates(seq))
        logprobs = {lp.rid: lp for lp in result.logprobs}
        for rid, token_id in result.sampled:
            seq = self.seqs.get(rid)
            if seq is None or seq.finish_reason is not None or not seq.announced:
                self.samples_dropped += 1  # ended or preempted while the step ran (a step planned ahead: on its last token)
                continue
            seq.in_flight -= 1
            seq.output_ids.append(token_id)
            reason = self._check_finish(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
            updates.append(
                SeqUpdate(rid, token_id, reason, logprobs.get(rid), seq.request_id, seq.index, seq.cached_tokens)
            )
        return updates

    def fail_step(self, step_id: int) -> list[str]:
        """The step in flight failed on a worker: abort its requests and forget the embeddings it was
        to store (the workers may not hold them). Returns the aborted rids."""
        if not self._in_flight or self._in_flight[0].step_id != step_id:
            raise RuntimeError(f"step {step_id} is not the step in flight")
        plan = self._in_flight.popleft()
        for job in plan.encode:
            self.mm_index.discard(job.key)
        # Whole requests: a failed choice fails its siblings too.
        rids = list(dict.fromkeys(self.seqs[c.rid].request_id for c in plan.chunks if c.rid in self.seqs))
        for rid in rids:
            self.abort(rid)
        return rids

    def _check_finish(self, seq: Sequence, token_id: int) -> FinishReason | None:
        sp = seq.sampling
        if (not sp.ignore_eos and token_id in self.eos_token_ids) or token_id in sp.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= sp.max_tokens or seq.total_len >= self.max_model_len:
            return "length"
        return None

    def finish(self, rid: str, reason: FinishReason) -> None:
        """End a request from outside (a stop string matched, the client went away)."""
        seq = self.seqs.get(rid)
        if seq is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table or seq.fork_blocks:
            self.allocator.free(seq.block_table + seq.fork_blocks)
            seq.block_table, seq.fork_blocks = [], []
        if seq.announced:
            self._finished_for_workers.append(seq.rid)
        if self.seqs.pop(seq.rid, None) is None:
            return  # finished before
        family = self.families.get(seq.request_id)
        if family is not None:
            family.remove(seq)
            if family:
                return  # the request's pixels stay until its last choice is done
            del self.families[seq.request_id]
        if self.on_finished is not None:
            self.on_finished(seq)
