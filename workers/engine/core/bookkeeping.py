"""The sequences a scheduling core tracks, and everything that happens to them outside step planning.

``SequenceBook`` holds the core's state (the waiting and running queues, every live sequence by rid, n > 1 and
batched-prompt families, the KV allocator, the embedding-cache index, the steps in flight) and its request-side
operations: queueing a request, images becoming ready, aborts and finishes, and applying a step's result
(publishing completed KV blocks to the prefix cache, appending sampled tokens, ending sequences). Planning the
next step over that state is scheduler.py's ``SchedulerCore``, which derives from it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Literal

from ipc.prompts import MMItem, SamplingParams
from ipc.steps import StepPlan, StepResult
from workers.engine.core.host_kv_index import HostCopies, HostKVIndex
from workers.engine.core.kv_cache import BlockAllocator, block_hashes
from workers.engine.core.mm_cache import EmbeddingCacheIndex
from workers.engine.core.remote_encodes import RemoteEncodes
from workers.engine.core.sequence import (
    FinishReason,
    RequestRejected,
    Sequence,
    SeqUpdate,
    check_prompt,
    child_rid,
    combined_mm_key,
    prompt_only_updates,
)
from workers.engine.core.state_cache import CHUNK_ALIGN, StatePool
from workers.engine.core.window_blocks import WindowBlocks


class SequenceBook:
    """A scheduling core's sequences and their lifecycle: added, made ready, sampled into, finished."""

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
        mm_host_cache_bytes: int = 0,
        mm_cache_mode: Literal["image", "request"] = "image",
        enable_prefix_caching: bool = True,
        lone_prefill_tokens: int = 0,
        decode_step_image_tokens: int = 0,
        encode_token_cost: float = 0.0,
        encode_ahead_tokens: int = 0,
        state_slots: int = 0,
        state_snapshot_every: int = 16,
        whole_images: bool = False,
        window: int = 0,
        window_blocks: int = 0,
        kv_host_slots: int = 0,
        remote_encodes: bool = False,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.chunk_size = chunk_size
        # Budget of a step with no decoding sequence: no one's inter-token latency depends on it, and a lone
        # prompt's prefill gets fewer, larger chunks (fewer steps, better GEMM and attention shapes).
        self.lone_prefill_tokens = max(chunk_size, lone_prefill_tokens)
        # Image tokens a step with decodes may encode (0: no cap); what is left of it while a step is planned (None:
        # no cap this step) and the images the step encodes so far (SchedulerCore._cap_encodes).
        self.decode_step_image_tokens = max(0, decode_step_image_tokens)
        self._encode_left: int | None = None
        self._encoding: set[bytes] = set()
        # Tokens of a step's budget that each image token it sends through the vision encoder costs, in a step with
        # decodes (0: encodes are free), and the cost in force for the step being planned (ChunkSizing).
        if encode_token_cost < 0:
            raise ValueError("encode_token_cost must be >= 0")
        self.encode_token_cost = encode_token_cost
        self._encode_cost = 0.0
        self._prefill_tokens = 0  # prefill tokens the step being planned has picked so far (decodes not counted)
        # Image tokens a step may encode for later steps beside its forward (core/encode_ahead.py; 0: none).
        self.encode_ahead_tokens = max(0, encode_ahead_tokens)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.mm_cache_mode = mm_cache_mode
        self.prefix_caching = enable_prefix_caching
        self.mm_index = EmbeddingCacheIndex(mm_cache_bytes, embedding_bytes_per_token, mm_host_cache_bytes)
        # Encoder workers (--encoder-workers) encode images ahead of their chunks; plans import what they landed.
        if remote_encodes and mm_cache_mode != "image":
            raise ValueError("encoder workers need the per-image embedding cache (mm_cache_mode 'image')")
        self.remote = RemoteEncodes(self.mm_index) if remote_encodes else None
        # Hybrid models (state_slots > 0): the linear-attention state pool, its snapshots kept under block keys,
        # a snapshot planned every ``state_snapshot_every`` blocks of a prompt (0: only at its last full block).
        self.state = StatePool(state_slots) if state_slots > 0 else None
        self.state_snapshot_every = state_snapshot_every
        # Where a hybrid model's prefill chunks end inside a prompt (chunking.py): on the kernels' chunk grid, unless
        # steps are so small (under 4 grid cells) that cutting each back to the grid would cost a large share of it.
        self.chunk_align = CHUNK_ALIGN if self.state is not None and chunk_size >= 4 * CHUNK_ALIGN else 1
        # Image tokens attend to each other both ways (ModelSpec.bidirectional_images): a chunk never ends inside an
        # image's span (`fit_chunk`).
        self.whole_images = whole_images
        self._state_copies: list[tuple[int, int]] = []  # restores planned for the next step: (snapshot, live slot)
        # (sequence, block boundary, key) of a published snapshot: KV-cache events' BlockStored of the state group.
        self.on_snapshot_stored: Callable[[Sequence, int, bytes], None] | None = None
        self._snapshot_at: dict[int, tuple[Sequence, int]] = {}  # pending slot -> its sequence and boundary (events)
        if self.state is not None:
            self.allocator.on_unregister = self.state.drop
        # Families with sliding-window layers (window > 0): those layers' own block pool (window_blocks.py).
        self.windows = WindowBlocks(window_blocks, block_size, window) if window > 0 and window_blocks > 0 else None
        if self.windows is not None and self.state is not None:
            # A prefix hit would have to end at a state snapshot and have its window resident (_cached_prefix
            # does one or the other): no family needs both yet.
            raise ValueError("a window pool and a linear-attention state pool together are not supported")
        # The host-RAM tier under the prefix cache (kv_host_slots > 0 and prefix caching on): blocks the allocator
        # recycles spill there, and admission continues a prompt's device hit with loads from it
        # (SchedulerCore._load_from_host). Neither a state snapshot nor a window pool travels with a block.
        if kv_host_slots > 0 and enable_prefix_caching:
            if self.state is not None or self.windows is not None:
                raise ValueError("the KV host tier takes no linear-attention state pool or window pool")
            self.allocator.host = HostKVIndex(kv_host_slots, block_size)
        # Each step's host-tier copies and their keys, until its result is back (fail_step forgets them).
        self._host_steps: dict[int, HostCopies] = {}
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
        self.images_ahead = 0  # of those, encoded by a step before the one that reads them
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
        if self.windows is not None:  # its window plus its longest chunk (an image's span is never cut: whole_images)
            longest = max([self.lone_prefill_tokens, *(it.length for it in items if self.whole_images)])
            need = self.windows.per_sequence(longest) + max(0, sampling.n - 1)
            if need > self.windows.allocator.num_blocks:
                raise RequestRejected(
                    f"a sequence needs {need} sliding-window KV blocks, the window pool has "
                    f"{self.windows.allocator.num_blocks} in all"
                )
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
            if self.remote is not None and seq in self.running:  # its new pixels can go to an encoder now
                self.remote.admit(seq)


    def abort(self, rid: str) -> bool:
        """End request ``rid``: all its choices."""
        family = self.families.get(rid)
        seqs = list(family) if family is not None else [self.seqs[rid]] if rid in self.seqs else []
        for seq in seqs:
            self._finish(seq, "abort")
        return bool(seqs)


    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_for_workers)

    # ---- results --------------------------------------------------------------------------------
    def update(self, result: StepResult) -> list[SeqUpdate]:
        if not self._in_flight or self._in_flight[0].step_id != result.step_id:
            raise RuntimeError(f"result for step {result.step_id} does not match the step in flight")
        plan = self._in_flight.popleft()  # results come back in the order the steps were sent
        self._host_steps.pop(plan.step_id, None)
        prompt_only: list[Sequence] = []  # max_tokens 0: the prompt was all there was to compute
        for chunk in plan.chunks:
            seq = self.seqs.get(chunk.rid)
            if seq is not None and seq.finish_reason is None and seq.announced:
                seq.num_computed = chunk.start + chunk.length
                self._register_blocks(seq)
                if seq.sampling.max_tokens == 0 and seq.num_computed >= seq.prompt_len:
                    prompt_only.append(seq)
        self._settle_snapshots(plan, failed=False)
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


    def _settle_snapshots(self, plan: StepPlan, failed: bool) -> None:
        """The step's state snapshots are computed: publish each whose block is in the prefix cache (its sequence's
        KV there was registered above; without it no request could ever match the snapshot), free the others'."""
        if self.state is None:
            return
        for _, _, slot in plan.snapshots:
            key = self.state.pending_key(slot)
            at = self._snapshot_at.pop(slot, None)
            if failed or not self.allocator.is_cached(key):
                self.state.cancel(slot)
            elif self.state.publish(slot) and at is not None and self.on_snapshot_stored is not None:
                self.on_snapshot_stored(at[0], at[1], key)

    def _release_state(self, seq: Sequence) -> None:
        """A sequence ends or loses its KV: its live slot (and its unforked choices') go back to the pool."""
        if self.state is not None and seq.state_slot >= 0:
            self.state.release([seq.state_slot, *seq.fork_slots])
        seq.state_slot, seq.fork_slots = -1, []

    def _register_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full blocks to the prefix cache."""
        bs = self.allocator.block_size
        full = min(seq.num_computed // bs, len(seq.block_table))
        if not self.prefix_caching or full <= seq.registered:
            return
        hashes = block_hashes(seq.all_token_ids(), bs, full, seq.block_hashes, seq.items)
        stored = [i for i in range(seq.registered, full) if self.allocator.register(seq.block_table[i], hashes[i])]
        if self.windows is not None:
            self.windows.register(seq, seq.registered, full, hashes)
        seq.registered = full
        if stored and self.on_blocks_stored is not None:
            self.on_blocks_stored(seq, stored, hashes)


    def fail_step(self, step_id: int) -> list[str]:
        """The step in flight failed on a worker: abort its requests and forget the embeddings it was
        to store (the workers may not hold them). Returns the aborted rids."""
        if not self._in_flight or self._in_flight[0].step_id != step_id:
            raise RuntimeError(f"step {step_id} is not the step in flight")
        plan = self._in_flight.popleft()
        encoded = [job.key for job in plan.encode] + [imp.key for imp in plan.mm_import]
        self.mm_index.fail_step(encoded, plan.mm_spill, plan.mm_reload)
        self._settle_snapshots(plan, failed=True)
        # Whole requests: a failed choice fails its siblings too.
        seqs = [self.seqs[c.rid] for c in plan.chunks if c.rid in self.seqs] + self._fail_host_copies(plan.step_id)
        rids = list(dict.fromkeys(seq.request_id for seq in seqs))
        for rid in rids:
            self.abort(rid)
        return rids

    def _fail_host_copies(self, step_id: int) -> list[Sequence]:
        """A failed step may have left any of its host-tier copies undone: its spilled keys leave the host tier, and
        the device blocks its loads filled, or that later loads filled from the slots it spilled to, lose their keys;
        the running sequences holding such blocks are returned, to fail with the step."""
        host, copies = self.allocator.host, self._host_steps.pop(step_id, None)
        if host is None or copies is None:
            return []
        written = {slot for _, slot in copies.spilled}
        later = [self._host_steps[p.step_id] for p in self._in_flight if p.step_id in self._host_steps]
        suspect = list(copies.loaded)
        for step in [*later, host.pending]:
            suspect += [key for (slot, _), key in zip(step.load, step.loaded, strict=True) if slot in written]
        host.forget(copies.spilled)
        for digest, block in suspect:
            self.allocator.unregister(block, digest)
        blocks = {block for _, block in suspect}
        return [seq for seq in self.running if blocks.intersection(seq.block_table)]

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
        if self.windows is not None:
            self.windows.free_all(seq)
        self._release_state(seq)
        if self.remote is not None:
            self.remote.forget(seq)
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
