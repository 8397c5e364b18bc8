"""Scheduling core: continuous batching with chunked prefill, KV admission control and the
embedding-cache plan. Pure bookkeeping: it never touches tensors or pixels, so the same object
runs inside the offline ``Engine`` and inside the scheduler process. This module plans steps; how long each chunk
is comes from chunking.py's ``ChunkSizing``, its base, and the sequences it plans over, the requests' lifecycle
and the step results from bookkeeping.py's ``SequenceBook``, that one's base.

Each step spends a token budget (``chunk_size``; ``lone_prefill_tokens`` when no sequence is decoding):
running decodes first (one token each), then prefill chunks of running sequences, then newly admitted
requests. A request is admitted only
when KV blocks for its whole prompt are free now; one that could never fit is rejected in ``add``.
A decode that needs a block when none is free preempts the newest running sequence, which is
recomputed later.
"""

from __future__ import annotations

from ipc.prompts import MMItem
from ipc.steps import EmbeddingImport, Fork, NewSeq, SeqChunk, StepPlan
from workers.engine.core import encode_ahead
from workers.engine.core.chunking import ChunkSizing
from workers.engine.core.host_kv_index import HostCopies
from workers.engine.core.kv_cache import block_hashes
from workers.engine.core.sequence import (
    FinishReason,
    RequestRejected,
    Sequence,
    SeqUpdate,
    fork,
    fork_blocks_needed,
)
from workers.engine.core.state_cache import snapshot_points

__all__ = ["FinishReason", "RequestRejected", "SchedulerCore", "SeqUpdate", "Sequence"]


class SchedulerCore(ChunkSizing):
    """Plans each step over the sequences `SequenceBook` tracks: decodes, prefill chunks, admissions, preemptions,
    and the step plan that carries them to the model workers."""

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
        # (Encoder workers encode outside the steps: nothing of a step waits for the ViT, so no cap.)
        remote = self.remote is not None
        in_step = decoding and self.mm_cache_mode == "image" and not remote  # encodes this step's decodes wait for
        cap = self.decode_step_image_tokens if in_step else 0
        self._encode_left, self._encoding = (cap or None), set()
        self._encode_cost = self.encode_token_cost if in_step else 0.0
        self._prefill_tokens = 0
        picked: list[tuple[Sequence, int]] = []
        # Decodes first: they are one token each and keep latency flat.
        for seq in sorted(plannable, key=lambda s: s.planned_len - s.num_scheduled != 1):
            if budget <= 0:  # (an image's encode may cost more than the budget had left)
                break
            if seq not in self.running:  # preempted while making room for an earlier one
                continue
            length = self._chunk_length(seq, budget)
            if length <= 0:  # waiting for an image to be written, or all of it is in flight
                continue
            if not self._ensure_blocks(seq, seq.num_scheduled + length, {s for s, _ in picked}, ahead):
                continue
            picked.append((seq, length))
            budget -= length + self._charge_encodes(seq, seq.num_scheduled, length)
            if seq.num_scheduled < seq.prompt_len:
                self._prefill_tokens += length
        # (On a hybrid model's chunk grid a budget under one cell funds no new chunk: admitting would only take slots.)
        while budget >= self.chunk_align and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached, snapshot, window_table = self._cached_prefix(seq)
            extra = fork_blocks_needed(seq.prompt_len, seq.sampling.n, self.allocator.block_size) if seq.wants_fork else 0
            need = self.allocator.blocks_for(seq.total_len + 1) - len(cached) + extra
            if need > self.allocator.num_free - self.allocator.reusable_free(cached):
                break  # it fits later, once running requests free blocks; keep FCFS order
            if not self._window_fits(seq, window_table, len(cached) * self.allocator.block_size, budget, extra):
                break
            slots = seq.sampling.n if seq.wants_fork else 1  # hybrid models: a live state slot per choice
            if self.state is not None and slots > self.state.available:
                break
            self.waiting.pop(0)
            if cached:  # the prompt starts with blocks another request computed: share them, skip their prefill
                self.allocator.acquire(cached)
            # Past the device hit, the prefix may go on in the host tier: fresh blocks, filled before the forward
            # (taken after the acquire, so that these allocations cannot recycle the hit's own blocks).
            loaded = self._load_from_host(seq, len(cached))
            if cached or loaded:
                seq.block_table = cached + loaded
                seq.registered = len(seq.block_table)
                seq.num_computed = seq.num_scheduled = len(seq.block_table) * self.allocator.block_size
                if not seq.output_ids:  # a first admission, not the recompute after a preemption
                    seq.cached_tokens = seq.num_computed
            if self.state is not None:
                # Taken before the live slots, so that they cannot evict it first (if they take its slot, the copy
                # runs before this step's forward writes there, so it is still right).
                source = self.state.use(snapshot, seq.num_computed) if snapshot is not None else -1
                seq.state_slot, *seq.fork_slots = self.state.allocate(slots)
                if source >= 0:
                    self._state_copies.append((source, seq.state_slot))
            seq.block_table.extend(self.allocator.allocate(need - extra - len(loaded)))
            seq.fork_blocks = self.allocator.allocate(extra)
            self.running.append(seq)
            if self.remote is not None:  # its images go to the encoder workers now, ahead of its chunks
                self.remote.admit(seq)
            length = self._chunk_length(seq, budget)
            if self.windows is not None:  # the hit's window blocks, then the first chunk's (checked free above)
                self.windows.acquire(window_table)
                seq.window_table = list(window_table)
                self.windows.extend(seq, seq.num_scheduled + max(0, length))
                seq.window_fork_blocks = self.windows.allocator.allocate(extra)
            if length > 0:  # else admitted (its blocks are reserved) but waiting for an image to be written
                picked.append((seq, length))
                budget -= length + self._charge_encodes(seq, seq.num_scheduled, length)
                self._prefill_tokens += length
        if not picked and (ahead or not self._finished_for_workers):
            return None  # (a step planned ahead for the finished alone is not worth it: the next plan takes them)
        plan = self._build_plan(picked, ahead)
        self._in_flight.append(plan)
        return plan

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], bytes | None, list[int]]:
        """The cached blocks the sequence's prompt starts with, on a hybrid model the key of the state snapshot at
        their end (there the prefix ends at the deepest block with a snapshot, or is empty), and with sliding-window
        layers the hit's window table (the prefix ends where the window pool still holds every block the next
        query sees)."""
        if not self.prefix_caching or seq.sampling.prompt_logprobs is not None:  # it must compute every position
            return [], None, []
        bs = self.allocator.block_size
        # Leave at least the last token to compute: its logits give the first sampled token.
        limit = (seq.total_len - 1) // bs
        hashes = block_hashes(seq.all_token_ids(), bs, limit, seq.block_hashes, seq.items)
        blocks = self.allocator.match(hashes)
        window_table: list[int] = []
        if self.windows is not None:
            depth, window_table = self.windows.prefix(hashes, len(blocks))
            blocks = blocks[:depth]
        if self.state is None:
            return blocks, None, window_table
        for depth in range(len(blocks), 0, -1):
            if self.state.lookup(hashes[depth - 1]) is not None:
                return blocks[:depth], hashes[depth - 1], []  # (no window pool beside a state pool: SequenceBook)
        return [], None, []

    def _load_from_host(self, seq: Sequence, depth: int) -> list[int]:
        """Device blocks for the host tier's continuation of ``seq``'s prefix past its first ``depth`` blocks (the
        device hit), registered under their keys with their loads queued for the next plan; published as stored, as
        a computed block is (they are on the device again once the step's copies ran, before anything reads them)."""
        alloc = self.allocator
        if alloc.host is None or not self.prefix_caching or seq.sampling.prompt_logprobs is not None:
            return []
        limit = (seq.total_len - 1) // alloc.block_size  # as in _cached_prefix, whose call computed these keys
        keys = seq.block_hashes[depth:limit]
        blocks = alloc.load_from_host(keys)
        if blocks and self.on_blocks_stored is not None:
            stored = [depth + i for i, block in enumerate(blocks) if alloc.lookup(keys[i]) == block]
            if stored:
                self.on_blocks_stored(seq, stored, seq.block_hashes)
        return blocks

    def _window_fits(self, seq: Sequence, window_table: list[int], start: int, budget: int, extra: int) -> bool:
        """Whether the window pool holds what admitting ``seq`` takes there now: the hit's blocks that sit free, the
        first chunk's and the choices' copies of the partial prompt block."""
        if self.windows is None:
            return True
        scheduled = seq.num_scheduled
        seq.num_scheduled = start  # (the first chunk's length as it will be planned, from the hit's end)
        length = self._chunk_length(seq, budget)
        seq.num_scheduled = scheduled
        alloc = self.windows.allocator
        new = max(0, alloc.blocks_for(start + max(0, length)) - len(window_table))
        return new + extra <= alloc.num_free - self.windows.reusable_free(window_table)


    def _ensure_blocks(self, seq: Sequence, num_tokens: int, picked: set[Sequence], ahead: bool = False) -> bool:
        need = self.allocator.blocks_for(num_tokens) - len(seq.block_table)
        windows = self.windows
        if windows is not None:  # blocks before the chunk's window go back first (see window_blocks.py)
            windows.release(seq, seq.num_scheduled)

        def short() -> bool:
            if need > 0 and not self.allocator.can_allocate(need):
                return True
            return windows is not None and not windows.allocator.can_allocate(windows.need(seq, num_tokens))

        if ahead and short():
            # A step in flight may still write the victim's blocks, and its result would land on a sequence that
            # lost its KV: no preemption now. The next plan waits for the results and preempts if it must.
            self._drain = True
            return False
        while short():
            # The newest sequence not already in this step loses its KV (it alone, if nothing else is left).
            victim = max((s for s in self.running if s not in picked), key=lambda s: s.arrival)
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.allocator.allocate(need))
        if windows is not None:
            windows.extend(seq, num_tokens)
        return True


    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's KV and queue it for recompute (prompt + tokens so far)."""
        self.preemptions += 1
        self.running.remove(seq)
        self.allocator.free(seq.block_table + seq.fork_blocks)
        seq.block_table, seq.fork_blocks = [], []
        if self.windows is not None:
            self.windows.free_all(seq)
        self._release_state(seq)
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
        snapshots: list[tuple[str, int, int]] = []
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
                    new_window_blocks=seq.window_table[seq.sent_window_blocks :],
                )
            )
            seq.in_flight += chunks[-1].sample
            seq.sent_blocks = len(seq.block_table)
            seq.sent_window_blocks = len(seq.window_table)
            self.prompt_tokens_computed += max(0, min(start + length, seq.prompt_len) - start)
            for key, items in self._keys_for_chunk(seq, start, start + length):
                needed.setdefault(key, items)
            if self.state is not None and self.prefix_caching:
                snapshots.extend(self._plan_snapshots(seq, start, start + length))
            if chunks[-1].sample and seq.wants_fork:
                forks.extend(self._fork(seq))
        # With encoder workers the model workers have no tower: an entry the GPU tier refuses is copied from the host
        # tier for this step rather than encoded.
        # Images a later step reads, encoded by this one beside its forward (encode_ahead.py).
        early: dict[bytes, list[MMItem]] = {}
        if self.encode_ahead_tokens and self.remote is None and self.mm_cache_mode == "image":
            early = encode_ahead.pick(self.running, self.waiting, needed, self.mm_index, self.encode_ahead_tokens)
        mm = self.mm_index.plan({**needed, **early}, reload_refused=self.remote is not None)
        encode, num_ahead = encode_ahead.split(mm.encode, early)
        imports: list[EmbeddingImport] = []
        if self.remote is not None:  # misses the encoder workers landed are imported, not encoded
            imports, encode = self.remote.imports(encode)
        self.images_planned += sum(len(job.items) for job in encode)
        self.images_ahead += num_ahead
        finished, self._finished_for_workers = self._finished_for_workers, []
        copies, self._state_copies = self._state_copies, []
        step_id = next(self._step_ids)
        # Every host-tier copy queued since the last plan (the allocations above and any made while planning
        # returned None) runs before this step's forward, which is the first that can write or read those blocks.
        host = self.allocator.host.drain() if self.allocator.host is not None else HostCopies()
        if host.spill or host.load:
            self._host_steps[step_id] = host
        return StepPlan(
            step_id, new_seqs, chunks, mm.evict, encode, finished, forks=forks, ahead=ahead, encode_ahead=num_ahead,
            state_copies=copies, snapshots=snapshots, mm_host_evict=mm.host_evict, mm_spill=mm.spill,
            mm_reload=mm.reload, mm_reload_once=mm.reload_once, kv_spill=host.spill, kv_load=host.load, mm_import=imports,
        )  # fmt: skip

    def _plan_snapshots(self, seq: Sequence, start: int, end: int) -> list[tuple[str, int, int]]:
        """Snapshots of the sequence's state at the block boundaries of its prompt in (start, end] worth keeping,
        each under its block's prefix key, in a slot reserved now (published with the step's result)."""
        if self.state is None or seq.sampling.prompt_logprobs is not None:
            return []  # (a request with prompt logprobs never matches a prefix, see _cached_prefix)
        bs = self.allocator.block_size
        points = snapshot_points(start, end, seq.prompt_len, bs, self.state_snapshot_every)
        if not points:
            return []
        hashes = block_hashes(seq.all_token_ids(), bs, points[-1] // bs, seq.block_hashes, seq.items)
        out = []
        for point in points:
            key = hashes[point // bs - 1]
            if self.state.wanted(key) and (slot := self.state.reserve(key)) is not None:
                out.append((seq.rid, point, slot))
                if self.on_snapshot_stored is not None:
                    self._snapshot_at[slot] = (seq, point)
        return out


    def _fork(self, parent: Sequence) -> list[Fork]:
        out = []
        window = self.windows.allocator if self.windows is not None else None
        for child, spec in fork(parent, self.allocator, next(self._arrivals), window):
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
            seq.rid, seq.all_token_ids(), seq.mrope_delta, items, seq.sampling, seq.mm_key, len(seq.output_ids),
            seq.state_slot,
        )  # fmt: skip


    def _keys_for_chunk(self, seq: Sequence, start: int, end: int) -> list[tuple[bytes, list[MMItem]]]:
        """Embedding-cache keys the chunk [start, end) reads: only images whose span overlaps it."""
        overlapping = [it for it in seq.items if it.offset < end and it.offset + it.length > start]
        if self.mm_cache_mode == "request":
            # Baseline: one entry for all the request's images, encoded with the first chunk.
            if seq.items and (start == 0 or overlapping):
                return [(seq.mm_key, seq.items)]
            return []
        return [(it.hash, [it]) for it in overlapping]
