"""Model-side execution of a ``StepPlan``: pixel reads, batched ViT, embedding store, LM forward
over the paged KV cache, sampling. One instance per model worker (per TP rank)."""

from __future__ import annotations

import logging
from dataclasses import replace

import msgspec
import torch

from ipc.landing import CudaLanding
from ipc.steps import EncodeJob, Fork, NewSeq, StepPlan, StepResult
from workers.common.step_trace import StepTrace
from workers.engine.config import EngineConfig
from workers.engine.kernels.attention import AttentionMetadata, StateMetadata
from workers.engine.layers.linear import TPGroup
from workers.engine.models import family as family_package
from workers.engine.models.base import NoVisionTower, item_spans
from workers.engine.models.load import defers_lm_weights, load_model
from workers.engine.runner.ahead_encodes import AheadEncodes, store_reads
from workers.engine.runner.batching import (
    aligned_pack,
    aligned_split,
    cumsum,
    split_by_patches,
    to_device,
)
from workers.engine.runner.cache_memory import (
    RecurrentState,
    allocate_kv_caches,
    attach_kv_scales,
    cache_budget,
    copy_kv_blocks,
    embedding_store,
    host_embeddings,
    num_kv_blocks,
    num_window_blocks,
    state_slots,
)
from workers.engine.runner.cuda_graphs import DecodeGraphs, graphs_wanted, start_graphs
from workers.engine.runner.encoder import JobEncoder, PixelSource, RunnerCounters, import_entries
from workers.engine.runner.grammar import GrammarBook
from workers.engine.runner.host_kv import host_kv_pool
from workers.engine.runner.landing import LandingReader
from workers.engine.runner.launch_poll import LaunchPoll, poll_points
from workers.engine.runner.piecewise_graphs import PiecewiseGraphs
from workers.engine.runner.prompt_logprobs import score_prompts
from workers.engine.runner.sampler import Sampler
from workers.engine.runner.step_inputs import Launched, StepInputs, WorkerSeq, ahead_token_ids, gather_inputs
from workers.engine.runner.warmup import (
    probe_paged_decode,
    warm_fused,
    warm_largest_step,
    warm_state_snapshots,
    warm_vision_attention,
)

__all__ = ["Launched", "ModelRunner", "WorkerSeq", "split_by_patches", "to_device"]

log = logging.getLogger("glimpse.model")

CUDA_HOST_THREADS = 4


class ModelRunner:
    def __init__(self, cfg: EngineConfig, pixel_source: PixelSource, tp: TPGroup | None = None) -> None:
        self.cfg = cfg
        self.tp = tp or TPGroup()
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            # A CUDA worker's host work is packing lists and staging copies. torch's OpenMP pool, one thread
            # per core, spins between those ops and starves the threads that matter here (grammar masks of
            # 32 sequences: 7.9 ms a step with 16 threads, 1.3 ms with 4, on the H200 box's 16 cores).
            torch.set_num_threads(min(torch.get_num_threads(), CUDA_HOST_THREADS))
        self.dtype = cfg.torch_dtype()
        self.spec = cfg.model_spec()
        self.family = family_package(self.spec.family)
        self.merge = self.spec.spatial_merge_size
        # Without the tower (--encoder-workers) nothing of it is allocated or read, and the caches sized below from
        # the memory left (cache_budget) get its bytes.
        built = self.family.build(self.spec, self.tp, self.dtype, self.device, cfg.attn_backend, vision=cfg.vision_tower,
                                  defer_lm_weights=defers_lm_weights(cfg.model, cfg.load_format, self.device))
        self.model = load_model(built, cfg.model, load_format=cfg.load_format, rank=self.tp.rank)
        self.lm, self.vision = self.model.lm, self.model.vision
        if self.vision is not None:
            self.vision.call_plans.resize(int(cfg.vit_plan_cache_mb * 2**20))
        self.launch_poll = LaunchPoll(poll_points(self.lm, self.vision))  # the worker reports finished steps there
        self.weight_bytes = _param_bytes(self.model)
        self.vision_weight_bytes = _param_bytes(self.vision) if self.vision is not None else 0
        log.info(
            "%s ready: %d layers, tp %d/%d, %s on %s, %.1f MiB of weights (%s)",
            self.spec.architecture,
            self.spec.num_layers,
            self.tp.rank,
            self.tp.size,
            self.dtype,
            self.device,
            self.weight_bytes / 2**20,
            "no vision tower: encoder workers run it" if self.vision is None else "vision tower included",
        )
        # The embedding store first: on CUDA it reserves its budget before the caches take their share of what is free.
        self.store = embedding_store(cfg, self.spec, self.dtype, self.device)
        self.host = host_embeddings(cfg, self.spec, self.dtype, self.device)  # its spills and reloads: StepPlan
        budget = cache_budget(cfg, self.device)
        self.state: RecurrentState | None = None
        if self.spec.recurrent is not None:  # hybrid: the linear-attention layers' state pools come out of the budget
            slots = state_slots(cfg, self.spec.recurrent, budget, self.dtype, self.tp.size)
            self.state = RecurrentState(self.lm, slots, self.dtype, self.device)
            budget = max(0, budget - self.state.nbytes)
        # Sliding-window layers (Gemma 4) keep a block pool of their own, sized first (core/window_blocks.py).
        self.window = self.spec.window  # (the scheduler keeps no window pool where num_window_blocks is 0)
        self.kv_dtype = kv = cfg.kv_torch_dtype()  # attention KV only (state pools: model dtype); budget in its bytes
        self.num_window_blocks = num_window_blocks(cfg, self.spec, kv, self.tp.size, budget)
        if self.num_window_blocks:
            per_block = self.spec.kv_bytes_per_block(cfg.block_size, kv, self.tp.size, windowed=True)
            budget = max(0, budget - self.num_window_blocks * per_block)
        self.num_blocks = num_kv_blocks(cfg, self.spec, kv, self.tp.size, budget, self.num_window_blocks > 0)
        caches = allocate_kv_caches(self.spec, self.model, self.num_blocks, self.num_window_blocks, cfg.block_size,
                                    self.tp.size, kv, self.device)
        self.kv_caches = attach_kv_scales(caches, cfg, self.spec, self.tp)
        self.host_kv = host_kv_pool(cfg, self.spec, self.kv_caches)  # the prefix cache's host tier (or None: off)
        if self.device.type == "cuda":  # before the warm-up and graphs below pick a decode attention path
            probe_paged_decode(self, kv)
            if self.vision is not None:
                warm_vision_attention(self)
        if cfg.fused_kernels and self.device.type == "cuda":
            warm_fused(self)  # before any graph capture: a capture must never be a kernel's first launch
        if self.device.type == "cuda":
            warm_largest_step(self)  # the first large request's allocations, paid before "ready"
            warm_state_snapshots(self)  # a hybrid model's snapshot kernels, compiled before the first prefix cache write
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if graphs_wanted(self.device, self.tp):
            self.graphs, self.piecewise = start_graphs(self)
        self.sampler = Sampler(self.device, cfg.seed, self.spec.vocab_size, self.spec.eos_token_ids)
        # Only rank 0 samples, so only rank 0 keeps grammars.
        self.grammar = GrammarBook(cfg.model, self.spec.vocab_size, self.spec.eos_token_ids) if self.tp.rank == 0 else None
        self.seqs: dict[str, WorkerSeq] = {}
        # The last step's sampled ids on the device, and each sequence's row in them: a step planned ahead
        # (asynchronous scheduling) reads its input ids from here. Cleared while a step runs, so a step after a
        # failed one cannot read stale ids.
        self.last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self.counters = RunnerCounters()
        self.landings = LandingReader(self.device)  # encoder workers' CUDA pools and NIXL agent, opened on first use
        self.encoder = JobEncoder(self.model, self.store, self.tp, pixel_source, self.counters, cfg.model, self.merge,
                                  self.spec.embed_width, cfg.vit_max_patches, self.device, self.dtype)
        # A step's encodes for later steps (core/encode_ahead.py); on CUDA it also sets the steps' stream.
        self.ahead = AheadEncodes(self.encoder, self.device, cfg.encode_ahead_tokens, self.tp.size)
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else None
        self.trace = StepTrace(f"worker{self.tp.rank}", sync, enabled=self.tp.rank == 0)

    @property
    def num_state_slots(self) -> int:
        return self.state.num_slots if self.state is not None else 0

    # ---- one step -------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step to its end (the offline Engine, tests)."""
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched:
        """Queue one step's GPU work; its result comes from the returned `Launched`."""
        self.trace.begin()
        self.ahead.wait(lambda: store_reads(plan, self.seqs))  # before this step reads or frees an entry being written
        if self.host_kv is not None:  # first: a spilled block is reused by this step, a loaded one read by it
            self.host_kv.apply(plan.kv_spill, plan.kv_load)
        last, self.last_sampled = self.last_sampled, None
        for rid in plan.finished:
            self.seqs.pop(rid, None)
            self.sampler.remove(rid)
            if self.grammar is not None:
                self.grammar.remove(rid)
        for new in plan.new_seqs:
            self._register(new)
        self.host.spill(plan.mm_host_evict, plan.mm_spill, self.store)  # StepPlan's order: spills read the store
        self.store.evict(plan.evict)
        reloading = self.host.reload(plan.mm_reload, plan.mm_reload_once)  # copies overlap the encodes; landed before the forward
        if plan.mm_import:  # encoder workers' entries, right before this step's own encodes (StepPlan's order)
            self.counters.imports += import_entries(plan.mm_import, self.store, self.device, self.dtype,
                                                   self.landings)
        self.trace.mark("setup")
        self.launch_poll()
        calls_before = self.counters.vit_calls
        if plan.encode and self.vision is None:  # the scheduler never plans one here; a clear error if it did
            raise NoVisionTower(f"step {plan.step_id} asks this model worker to encode {len(plan.encode)} entries, "
                                "but it has no vision tower (--encoder-workers: encoder workers encode every image)")
        cut = len(plan.encode) - plan.encode_ahead
        now, later = plan.encode[:cut], plan.encode[cut:]
        encoded = self.encoder.run(now) if now else 0
        self.host.land(reloading, self.store)
        launched = Launched(plan.step_id, encoded, self.counters.vit_calls - calls_before)
        self.trace.mark("vit")
        self.launch_poll()
        if self.counters.keep_per_step:  # one int a step, forever: off in a serving worker
            self.counters.encoded_per_step.append(encoded)
        self.counters.steps += 1
        self.ahead.mark(later)
        if not plan.chunks:
            self._encode_ahead(later, launched)
            return self._imports_read(plan, launched)
        if self.state is not None:  # requests resuming from a prefix snapshot start from a copy of it
            self.state.copy(plan.state_copies)
        try:
            self._forward(plan, launched, last)
            # Beside the forward just queued, and before end_step frees the rows of this step's transient entries,
            # which that forward still reads: an ahead entry must not be written there.
            self._encode_ahead(later, launched)
        finally:
            self.store.end_step()
        self.trace.mark("sample")
        if self.trace.enabled:
            decodes = sum(1 for c in plan.chunks if c.length == 1)
            tokens = sum(c.length for c in plan.chunks)
            captures = self.graphs.stats["captures"] if self.graphs is not None else 0
            self.trace.end(
                step=plan.step_id, seqs=len(plan.chunks), decodes=decodes, tokens=tokens, images=encoded,
                graph_captures=captures, ahead=plan.ahead,
            )  # fmt: skip
        return self._imports_read(plan, launched)

    def _encode_ahead(self, jobs: list[EncodeJob], launched: Launched) -> None:
        """The step's encodes for later steps, counted with its own (its result reports every ViT it ran)."""
        calls_before = self.counters.vit_calls
        launched.images_encoded += self.ahead.run(jobs)
        launched.vit_calls += self.counters.vit_calls - calls_before

    def _imports_read(self, plan: StepPlan, launched: Launched) -> Launched:
        """``launched``, done no sooner than this step's copies out of CUDA landing pools: once its result is in, the
        scheduler releases their ranges and the encoder writes new entries there. A step that samples already waits
        for its whole forward (and with TP the forward's collectives come after every rank's copies); one that does
        not (a prefill chunk that samples nothing) would be reported at once without this event."""
        if launched.event is None and self.device.type == "cuda" and any(
                isinstance(imp.embeddings, CudaLanding) for imp in plan.mm_import):
            launched.event = torch.cuda.Event()
            launched.event.record()
        return launched

    def _register(self, new: NewSeq) -> None:
        rows, offset = [], 0
        for item in new.items:
            rows.append(offset)
            offset += item.length
        self.seqs[new.rid] = WorkerSeq(
            new.rid,
            list(new.input_ids),
            self.family.positions(len(new.input_ids), item_spans(new.items), self.merge)[0],
            new.mrope_delta,
            new.items,
            new.sampling,
            new.mm_key,
            rows,
            state_slot=new.state_slot,
        )
        split = len(new.input_ids) - new.num_output
        if new.sampling.prompt_logprobs is not None and not new.num_output:  # a recompute after outputs: sent before
            self.seqs[new.rid].prompt_until = split - 1
        self.sampler.add(new.rid, new.sampling, new.input_ids[:split], new.input_ids[split:])
        if new.sampling.structured is not None and self.grammar is not None:
            self.grammar.add(new.rid, new.sampling.structured, new.input_ids[split:])

    def _forward(self, plan: StepPlan, launched: Launched, last: tuple[torch.Tensor, dict[str, int]] | None) -> None:
        """The step's LM forward and sampling, queued; fills ``launched``. ``last``: the step before's sampled ids
        on the device, and each sequence's row in them."""
        step = gather_inputs(plan, self.seqs, self.cfg.block_size, self.spec, self._fork, self.num_window_blocks)
        ids, pos, slots, seq_lens, tables = step.ids, step.positions, step.slots, step.seq_lens, step.tables
        splices, spans, sample_rows, sample_seqs = step.splices, step.spans, step.sample_rows, step.sample_seqs
        ahead_ids = ahead_token_ids(ids, step.ahead, last, self.device) if step.ahead else None
        self.trace.mark("prep")
        hidden: torch.Tensor | None = None
        graph_used = False
        if self.graphs is not None and not splices and not spans and len(ids) == len(plan.chunks) == len(sample_rows):
            # Pure decode (one token per sequence, all sampled, no image rows): replay a CUDA graph.
            try:
                hidden = self.graphs.run(ids, pos, slots, seq_lens, tables, ahead_ids, step.state_slots or None,
                                         step.window_slots, step.window_tables)
                graph_used = True
            except RuntimeError:  # graphs only save launches: keep serving, eagerly (it rewrites the same slots)
                if self.tp.size > 1:
                    raise  # the other ranks would wait in a captured all-reduce: fail the launch instead
                log.exception("CUDA-graph decode failed; decoding eagerly from now on")
                self.graphs = None
        if hidden is None:
            rows = sample_rows + [r for span in spans for r in span.rows]  # prompt logprobs: eager only
            hidden = self._eager_forward(step, rows, ahead_ids)
        if plan.forks:  # each choice's copy of the partial prompt block, after the forward wrote it
            copy_kv_blocks(self.kv_caches, self.spec.kv_windows if self.num_window_blocks else None,
                           [f.copy for f in plan.forks if f.copy is not None],
                           [f.window_copy for f in plan.forks if f.window_copy is not None], self.device)
            if self.state is not None:  # each choice goes on from a copy of its parent's state
                self.state.copy([(self.seqs[f.parent].state_slot, f.state_slot) for f in plan.forks])
        n, rank0 = len(sample_rows), self.tp.rank == 0
        if spans:  # every rank computes the logits (a gather over ranks); rank 0 alone returns entries
            launched.scored = score_prompts(hidden[n:], spans, self.model.compute_logits, self.spec.vocab_size, rank0)
        hidden = hidden[:n]
        if hidden.shape[0] == 0:
            return
        logits = self.model.compute_logits(hidden)
        self.trace.mark("graph" if graph_used else "forward")
        rids = [s.rid for s in sample_seqs]
        rows_of = {rid: row for row, rid in enumerate(rids)}
        if not rank0:
            # Rank 0 samples; the other ranks get its ids on the device, so a step planned ahead of this one's result
            # (asynchronous scheduling) finds its input ids here as on rank 0. Queued, the host does not wait.
            self.last_sampled = self.tp.broadcast(torch.empty(n, dtype=torch.int64, device=self.device)), rows_of
            return
        # Structured outputs: masks are filled here, on the CPU, while the GPU still runs the queued forward.
        mask = self.grammar.mask_for(rids) if self.grammar is not None else None
        out = self.sampler.sample(logits, rids, [s.sampling for s in sample_seqs], mask)
        self.tp.broadcast(out.device.contiguous())  # the same collective as the other ranks' above
        if mask is not None and self.grammar is not None:
            self.grammar.accept_all(rids, out.tokens)
        self.last_sampled = out.device, rows_of
        launched.rids, launched.logprobs = rids, out.pending
        if self.device.type == "cuda":
            # The ids come to the host by a queued copy, and the worker reads them once the event has passed: in
            # the meantime it can queue the next step (asynchronous scheduling).
            launched.tokens = torch.empty(len(rids), dtype=torch.int64, pin_memory=True)
            launched.tokens.copy_(out.device, non_blocking=True)
            launched.event = torch.cuda.Event()
            launched.event.record()
        else:
            launched.tokens = out.device

    def _fork(self, parent: WorkerSeq, forks: list[Fork]) -> list[WorkerSeq]:
        """The choices of an n > 1 request, registered as copies of the parent that has just computed its
        prompt (same tokens, positions and images; own block table and sampling state)."""
        children = []
        for spec in forks:
            params = msgspec.structs.replace(parent.sampling, n=1, seed=spec.seed)
            child = WorkerSeq(
                spec.child, list(parent.token_ids), parent.positions, parent.mrope_delta, parent.items, params,
                parent.mm_key, parent.item_rows, list(spec.block_table), state_slot=spec.state_slot,
                window_table=[b if b >= 0 else self.num_window_blocks for b in spec.window_table],
            )
            self.seqs[spec.child] = child
            self.sampler.fork(parent.rid, spec.child, params)
            if self.grammar is not None:
                self.grammar.fork(parent.rid, spec.child)
            children.append(child)
        return children

    def _eager_forward(self, step: StepInputs, sample_rows: list[int], ahead_ids: torch.Tensor | None = None) -> torch.Tensor:
        """LM forward over the flattened step; returns the final hidden states of ``sample_rows``. ``ahead_ids``
        replaces the step's ids (a step planned ahead: the ids are on the device only)."""
        ids, pos, query_lens, seq_lens, tables = step.ids, step.positions, step.query_lens, step.seq_lens, step.tables
        n, width = len(ids), max(len(t) for t in tables)
        mm_rows: list[int] = []
        for dst, _, _, count in step.splices:
            mm_rows.extend(range(dst, dst + count))
        # All index data in two copies (one per dtype) rather than eight, none of them blocking.
        state_parts = [step.state_slots, [int(b) for b in step.has_initial]] if self.state is not None else []
        # A window pool's slots and tables ride in the same copies (window_parts: empty without one).
        wtables = step.window_tables
        wwidth = max((len(t) for t in wtables), default=0)
        window_parts = [step.window_slots, [i for t in wtables for i in (*t, *[0] * (wwidth - len(t)))]]
        long_parts = [ids, [*pos[0], *pos[1], *pos[2]], step.slots, sample_rows, mm_rows, window_parts[0], *state_parts]
        longs = to_device([aligned_pack(long_parts, 2)], self.device)
        int_parts = [[0, *cumsum(query_lens)], seq_lens, [i for t in tables for i in (*t, *[0] * (width - len(t)))],
                     window_parts[1]]  # fmt: skip
        int32 = to_device([aligned_pack(int_parts, 4, torch.int32)], self.device)
        input_ids, positions, slot_mapping, rows, mm_index, window_slots, *state_rows = aligned_split(longs, long_parts, 2)
        starts, lens, table_rows, window_rows = aligned_split(int32, int_parts, 4)
        embeds = self.model.embed(input_ids if ahead_ids is None else ahead_ids)
        parts = [self.store.rows(key, first, count) for _, key, first, count in step.splices]
        mm_embeds = (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else None
        meta = AttentionMetadata(
            query_start_loc=starts,
            seq_lens=lens,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            slot_mapping=slot_mapping,
            block_tables=table_rows.view(len(tables), width),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            bidir_spans=step.bidir_spans if step.bidir_spans and any(step.bidir_spans) else None,
        )
        if wtables:  # the sliding layers' view: the same step through the window pool's tables and slots
            meta.window = replace(meta, slot_mapping=window_slots, block_tables=window_rows.view(len(wtables), wwidth),
                                  derived={})
        if state_rows:
            meta.state = StateMetadata(
                state_rows[0], step.state_slots, state_rows[1].bool(), step.has_initial, step.snapshots
            )
        deepstack = self.model.splice(embeds, mm_index, mm_embeds)
        hidden = None
        if self.piecewise is not None:  # small steps: graphs between the attention calls
            hidden = self.piecewise.run(embeds, positions.view(3, n), meta, deepstack)
        if hidden is None:
            hidden = self.lm(embeds, positions.view(3, n), self.kv_caches, meta, None, deepstack)
        return hidden[rows]


def _param_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers on this rank (what its weights hold on the device)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
