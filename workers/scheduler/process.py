"""Scheduler process: admission, continuous batching and detokenization between tokenizers, model
workers and frontend. One loop, never blocked on the model: it polls its PULL socket (requests,
aborts, step results), keeps one step in flight, and plans the next step the moment a result lands;
with asynchronous scheduling the next step also goes out while the one before it runs (see
``SchedulerCore.schedule(ahead=True)``). A plan is encoded once and the same bytes go to every TP rank;
plans carry shm pointers, never pixels, and this process never maps a segment. It is the only process that unlinks segments: a
request's names go when the request finishes, fails or is aborted (see ``_release``), and retained
ones after ``shm_retain_idle_s`` unused. If the launcher dies (SIGKILL, OOM) the scheduler notices
within a loop turn and removes every segment and the socket directory of the launch before it
exits: the other children die with the launcher, and nobody else would.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict, deque
from typing import Any

import msgspec
from transformers import AutoTokenizer

from ipc import endpoints
from ipc.channels import new_context
from ipc.control import AbortRequest, ProcessReady, RequestFailed, Shutdown
from ipc.inbound import SchedulerInbound
from ipc.launch import cleanup_launch_dir
from ipc.outputs import OutputBatch, RequestOutput
from ipc.prompts import MediaFailed, MediaReady, TokenizedRequest
from ipc.shm import ShmSegment, sweep
from ipc.stats import WorkerStats
from ipc.steps import StepPlan, StepResult, WorkerFailed
from workers.common.detokenizer import TextStream
from workers.common.proc import GcWatch, freeze_heap, setup_child
from workers.common.step_trace import StepTrace
from workers.common.tools import ToolOutput
from workers.config import ServerConfig
from workers.engine.core.scheduler import RequestRejected, SchedulerCore, Sequence
from workers.engine.core.sequence import child_rid
from workers.scheduler.kv_events import KVEventRecorder
from workers.scheduler.logprobs import LogprobRenderer, PromptLogprobBook
from workers.scheduler.shm_ledger import ShmLedger
from workers.scheduler.stats import LOG_STATS_INTERVAL_S, STATS_INTERVAL_S, snapshot

_MAX_DRAIN = 256  # messages handled per loop turn before the next step is planned
_RECENT_ABORTS = 65536  # aborts of rids not (yet) known; old entries fall out first
_LINGER_MS = 2_000
_ORPHANED = "the launcher is gone"


def _unlink_all(names: list[str]) -> None:
    for name in names:
        ShmSegment.unlink(name)


def build_core(config: ServerConfig, num_blocks: int) -> SchedulerCore:
    """The scheduling core for ``config`` with ``num_blocks`` KV blocks (the smallest rank's count)."""
    eng = config.engine
    info = eng.model_spec()
    return SchedulerCore(
        num_blocks=num_blocks,
        block_size=eng.block_size,
        chunk_size=eng.chunk_size,
        max_num_seqs=eng.max_num_seqs,
        # The launcher resolves max_model_len; the fallback (what the offline Engine does) serves direct callers.
        max_model_len=eng.max_model_len or info.max_position_embeddings,
        mm_cache_bytes=int(eng.mm_cache_mb * 2**20),
        embedding_bytes_per_token=info.embedding_bytes_per_token(eng.torch_dtype()),
        eos_token_ids=info.eos_token_ids,
        mm_cache_mode=eng.mm_cache_mode,
        enable_prefix_caching=eng.enable_prefix_caching,
        lone_prefill_tokens=eng.lone_prefill_tokens,
    )


class Scheduler:
    def __init__(self, config: ServerConfig, log: logging.Logger, replica: int = 0) -> None:
        self.config = config
        self.log = log
        self.replica = replica  # --dp: this scheduler's replica, whose model workers are replica * tp + rank
        ctx, lid = new_context(), config.launch_id
        self.ctx = ctx
        self.inbound = endpoints.pull(ctx, lid, endpoints.SCHEDULER, replica)
        tp, tokenizers = config.engine.tp_size, config.tokenizer_workers
        self.models = [endpoints.push(ctx, lid, endpoints.MODEL, replica * tp + r) for r in range(tp)]
        self.frontend = endpoints.push(ctx, lid, endpoints.FRONTEND)
        self.tokenizers = [endpoints.push(ctx, lid, endpoints.TOKENIZER, i) for i in range(tokenizers)]
        self.tokenizer: Any = AutoTokenizer.from_pretrained(config.engine.model)
        self.logprobs = LogprobRenderer(self.tokenizer)
        self.prompt_logprobs = PromptLogprobBook(self.logprobs)
        self.trace = StepTrace(f"scheduler{replica}")
        self.plan_encoder = msgspec.msgpack.Encoder()
        self.core: SchedulerCore  # built by wait_for_models, once every rank reported its KV blocks
        self.in_flight: deque[StepPlan] = deque()  # oldest first, as the results come back
        # Asynchronous scheduling needs the sampled ids on the device of every rank that runs the next step: with
        # TP > 1 rank 0 samples and broadcasts them (ModelRunner._forward).
        self.ahead = config.async_scheduling
        self.streams: dict[str, TextStream] = {}
        self.tool_outputs: dict[str, ToolOutput] = {}  # requests with tools: their <tool_call> parsers
        # Replicas split the budget, so together they keep to it (tokenizers add their reports up). Each counts
        # only its own requests' names: an image two replicas hold is counted twice, never unlinked early.
        budget = config.shm_budget_bytes // max(1, config.dp_size)
        self.ledger = ShmLedger(budget, config.shm_retain_fraction, config.shm_retain_idle_s)
        self.kv_events: KVEventRecorder | None = None
        self.parent = os.getppid()  # the launcher; a change means it died and this process was re-parented
        self.worker_stats: dict[int, WorkerStats] = {}
        self.gpu_peak = self.gpu_idle = 0  # bytes; the peak restarts whenever work starts from idle
        self.deferred_unlinks: list[str] = []
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.early: list[SchedulerInbound] = []  # arrived before the core existed
        self.stop_reason: str | None = None
        self.steps = self.generated_tokens = self.prompt_tokens = self.images_encoded = self.vit_batches = 0
        self.steps_ahead = 0
        self.gc: GcWatch  # started by wait_for_models once start-up is over (its collections are not serving's)
        # Encoded StepPlan sizes (pointers only, so they track tokens and image counts, not pixels).
        self.plan_bytes = {"last": 0, "max": 0, "total": 0}
        self.next_stats = self.next_log = 0.0

    def wait_for_models(self) -> bool:
        """Collect ProcessReady from every rank and build the core; False if told to stop first."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        blocks: dict[int, int] = {}
        while len(blocks) < len(self.models):
            if self.stop_reason is not None or self._orphaned():
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"model ranks other than {sorted(blocks)} never got ready")
            msg = self.inbound.recv(int(min(left, 0.2) * 1000))
            if msg is None:
                continue
            if isinstance(msg, ProcessReady) and msg.role == "model":
                blocks[msg.index] = msg.num_kv_blocks
                self.log.info("model rank %d ready: %d KV blocks", msg.index, msg.num_kv_blocks)
            elif isinstance(msg, Shutdown):
                self.stop_reason = msg.reason or "shutdown"
            else:
                self.early.append(msg)
        # Ranks may have sized their caches from different free memory: the smallest one binds all.
        self.core = build_core(self.config, min(blocks.values()))
        self.core.on_finished = self._release
        if (events := KVEventRecorder.open(self.ctx, self.config, self.replica)) is not None:
            self.kv_events = events.attach(self.core)
            self.log.info("publishing KV-cache events on %s", events.publisher.endpoint)
        self.gc = GcWatch(frozen=freeze_heap(self.log))
        self.frontend.send(ProcessReady(role="scheduler", index=self.replica, pid=os.getpid()))
        self.log.info("ready: %d KV blocks", self.core.allocator.num_blocks)
        return True

    def run(self) -> None:
        for early in self.early:
            self.handle(early)
        while self.stop_reason is None:
            # Sleep until a message or the next stats tick, then take whatever else is queued, so
            # requests that arrived together are planned into the same step; but plan as soon as a result is in
            # (with a step planned ahead, the next result may be queued already: it is the next turn's).
            timeout_ms = max(0, int((self.next_stats - time.monotonic()) * 1000))
            for _ in range(_MAX_DRAIN):
                msg = self.inbound.recv(timeout_ms)
                if msg is None:
                    break
                self.handle(msg)
                timeout_ms = 0
                if isinstance(msg, StepResult):
                    break
            if len(self.in_flight) < 2:
                self._schedule()
            if self.kv_events is not None:
                self.kv_events.flush()
            self.send_stats()
            self._orphaned()

    def handle(self, msg: SchedulerInbound) -> None:
        match msg:
            case StepResult():
                self._on_result(msg)
            case TokenizedRequest():
                self._on_request(msg)
            case AbortRequest(rid=rid):
                self._on_abort(rid)
            case MediaReady(rid=rid, hashes=hashes):
                published, gone = self.ledger.publish(rid, hashes)
                self.core.media_ready(rid, published)
                self.unlink(gone)
            case MediaFailed(rid=rid):
                self.unlink(self.ledger.pending_failed(rid))
                self._on_abort(rid)
            case WorkerFailed():
                self._on_worker_failed(msg)
            case WorkerStats(rank=rank):
                self.worker_stats[rank] = msg
                self.gpu_peak = max(self.gpu_peak, msg.gpu_step_peak_bytes)
            case Shutdown(reason=reason):
                self.stop_reason = reason or "shutdown"
            case _:
                self.log.warning("unexpected %s", type(msg).__name__)

    def _schedule(self) -> None:
        while not self.in_flight or (self.ahead and len(self.in_flight) == 1):
            started = time.monotonic()
            if (plan := self.core.schedule(ahead=bool(self.in_flight))) is None:
                return
            # Encode once, send the same bytes to every rank: each rank must see the identical plan. The
            # timestamp lets every rank measure the broadcast (CLOCK_MONOTONIC is one clock per host).
            plan = msgspec.structs.replace(plan, sent_at=time.monotonic())
            data = self.plan_encoder.encode(plan)
            for sock in self.models:
                sock.send_bytes(data)
            self.in_flight.append(plan)
            self.steps_ahead += plan.ahead
            n, sizes = len(data), self.plan_bytes
            sizes.update(last=n, max=max(sizes["max"], n), total=sizes["total"] + n)
            if self.trace.enabled:
                load = {"running": len(self.core.running), "waiting": len(self.core.waiting)}
                self.trace.event("plan", step=plan.step_id, start=started, bytes=n, ahead=plan.ahead, **load)

    def _on_request(self, req: TokenizedRequest) -> None:
        if not self.core.has_work() and not self.in_flight:
            self.gpu_peak = 0
            self.gpu_idle = max((w.gpu_allocated_bytes for w in self.worker_stats.values()), default=0)
        images = {it.hash: it.pixels.nbytes for it in req.items if it.pixels is not None}
        name_of = {it.hash: it.pixels.name for it in req.items if it.pixels is not None}
        # Images still being written: their names join the holding once published (MediaReady).
        pending = {h: name_of.pop(h) for h in req.pending if h in name_of}
        if req.rid in self.aborted:
            del self.aborted[req.rid]
            self._refuse(req, pending)
            return
        extra = self.ledger.extra_bytes(images)
        self.unlink(self.ledger.make_room(extra))
        if extra and self.ledger.used_bytes + extra > self.ledger.budget_bytes:
            self._refuse(req, pending, 503, "shared memory budget exceeded, retry later", "shm_budget_exceeded")
            return
        try:
            self.core.add(req.rid, req.input_ids, req.mrope_delta, req.items, req.sampling, req.more_prompts, pending)
        except ValueError as exc:
            # RequestRejected: an empty prompt, or one too long for the context or the KV cache; plain
            # ValueError: a duplicate rid (these names are this message's own links, safe to unlink).
            too_long = isinstance(exc, RequestRejected) and bool(req.input_ids)
            self._refuse(req, pending, 400, str(exc), "context_length_exceeded" if too_long else None)
            return
        published = [n for n in req.shm_names if n not in pending.values()]
        self.ledger.hold(req.rid, published, images, name_of, pending)
        prompts = [req.input_ids, *req.more_prompts]  # a batch of prompts: choice p answers prompt p
        self.prompt_tokens += (total := sum(len(p) for p in prompts))
        self.prompt_logprobs.expect(req.rid, prompts, req.sampling)
        self.trace.event("arrive", rid=req.rid, tokens=len(req.input_ids), images=len(req.items))
        for index in range(max(req.sampling.n, len(prompts))):  # one per choice: its own text and stop strings
            self.streams[child_rid(req.rid, index)] = TextStream(self.tokenizer, req.sampling.stop, total)
            if req.tool_parser:
                self.tool_outputs[child_rid(req.rid, index)] = ToolOutput()

    def _refuse(
        self, req: TokenizedRequest, pending: dict[bytes, str], status: int = 0, message: str = "", code: str | None = None
    ) -> None:
        """Drop a request on arrival (failing it with ``status`` unless 0): its names go, and so do those of images
        still being written, once they are."""
        _unlink_all(req.shm_names)
        self.ledger.orphan(req.rid, pending)
        if status:
            self._fail(req.rid, status, message, code)

    def _on_abort(self, rid: str) -> None:
        self._drop_streams(rid)
        if not self.core.abort(rid):
            # Unknown: its TokenizedRequest may still be on the way (another pipe); drop it on arrival.
            self.aborted[rid] = None
            if len(self.aborted) > _RECENT_ABORTS:
                self.aborted.popitem(last=False)

    def _drop_streams(self, rid: str) -> bool:
        """Forget the text streams of request ``rid`` (all its choices); whether it had any."""
        found = self.streams.pop(rid, None) is not None
        self.prompt_logprobs.drop(rid)
        self.tool_outputs.pop(rid, None)
        index = 1
        while self.streams.pop(child_rid(rid, index), None) is not None:
            self.tool_outputs.pop(child_rid(rid, index), None)
            index, found = index + 1, True
        return found

    def _release(self, seq: Sequence) -> None:
        """core.on_finished: the request (its last choice) will never be scheduled again, so its pixels can go."""
        self.unlink(self.ledger.release(seq.request_id))

    def _reading_pixels(self) -> bool:
        """Whether a step in flight may still read shm: one with images to encode (its worker maps their segments
        when it takes the plan, which may be after this process has moved on)."""
        return any(plan.encode for plan in self.in_flight)

    def send_stats(self, force: bool = False) -> None:
        """Every STATS_INTERVAL_S (or now, with ``force``): stats to the frontend and the tokenizers, retained images
        idle too long unlinked, and a log line every LOG_STATS_INTERVAL_S while there is work."""
        now = time.monotonic()
        if now < self.next_stats and not force:
            return
        self.next_stats = now + STATS_INTERVAL_S
        self.unlink(self.ledger.expire(now))  # retained images nobody resent for a while
        stats = snapshot(self)
        self.frontend.send(stats)
        for sock in self.tokenizers:
            sock.send(stats)
        core = self.core
        if now >= self.next_log and (core.running or core.waiting or self.log.isEnabledFor(logging.DEBUG)):
            self.next_log = now + LOG_STATS_INTERVAL_S
            self.log.info("%s plan_bytes=%s", msgspec.json.encode(stats).decode(), self.plan_bytes)

    def unlink(self, names: list[str]) -> None:
        if self._reading_pixels():
            # The step now running may still read these names (an encode job can point at a name of
            # an image another request shares): unlink once it is back.
            self.deferred_unlinks.extend(names)
        else:
            _unlink_all(names)

    def _fail(self, rid: str, status: int, message: str, code: str | None = None) -> None:
        self.log.info("request %s failed (%d): %s", rid, status, message)
        kind = "server_error" if status >= 500 else "invalid_request_error"  # OpenAI's error types
        self.frontend.send(RequestFailed(rid, status, message, type=kind, code=code))

    def _end_step(self, step_id: int) -> StepPlan | None:
        if not self.in_flight or self.in_flight[0].step_id != step_id:
            waiting_for = self.in_flight[0].step_id if self.in_flight else None
            self.log.warning("ignoring a report for step %d (in flight: %s)", step_id, waiting_for)
            return None
        self.steps += 1
        return self.in_flight.popleft()

    def _on_result(self, result: StepResult) -> None:
        started = time.monotonic()
        if self._end_step(result.step_id) is None:
            return
        self.images_encoded += result.images_encoded
        self.vit_batches += result.vit_calls
        outputs: list[RequestOutput] = []
        self.prompt_logprobs.collect(result.prompt_logprobs)
        for update in self.core.update(result):
            stream = self.streams.get(update.rid)
            if stream is None:
                continue
            token = [] if update.token_id is None else [update.token_id]  # none: max_tokens 0, the prompt alone
            self.generated_tokens += len(token)
            text, reason = stream.add(update.token_id, update.finish_reason)
            if reason is not None:
                if update.finish_reason is None:  # a stop string matched: the core did not know
                    self.core.finish(update.rid, "stop")
                del self.streams[update.rid]
            calls = None
            if (tools := self.tool_outputs.get(update.rid)) is not None:  # <tool_call> blocks -> tool_calls
                text, deltas, reason = tools.step(text, reason)
                calls = deltas or None
                if reason is not None:
                    del self.tool_outputs[update.rid]
            usage = (stream.prompt_tokens, stream.completion_tokens)
            lps = [self.logprobs.render(t, update.logprobs) for t in token] if update.logprobs is not None else None
            outputs.append(
                RequestOutput(
                    update.request_id, text, token, reason, *usage, lps, update.index, update.cached_tokens,
                    calls, self.prompt_logprobs.take(update.rid),
                )
            )
        self._flush_unlinks()
        if outputs:
            # When a request finishes, stats go first: the frontend answers it with stats that include it.
            self.send_stats(force=any(o.finish_reason for o in outputs))
            self.frontend.send(OutputBatch(outputs))
        self.trace.event("result", step=result.step_id, start=started, outputs=len(outputs))

    def _on_worker_failed(self, msg: WorkerFailed) -> None:
        self.log.error("model rank %d failed step %d: %s", msg.rank, msg.step_id, msg.message)
        plan = self._end_step(msg.step_id)
        if plan is None:
            return
        for rid in self.core.fail_step(plan.step_id):
            if self._drop_streams(rid):
                self._fail(rid, 500, f"the model failed on this request: {msg.message}")
        self._flush_unlinks()

    def _flush_unlinks(self) -> None:
        if self._reading_pixels():
            return
        names, self.deferred_unlinks = self.deferred_unlinks, []
        _unlink_all(names)

    def _orphaned(self) -> bool:
        if os.getppid() == self.parent:
            return False
        if self.stop_reason != _ORPHANED:
            self.log.error("the launcher (pid %d) is gone; removing the launch's shared memory and exiting", self.parent)
        self.stop_reason = _ORPHANED
        return True

    def close(self) -> None:
        """Unlink every live request's names, tell the model workers to exit, close the sockets."""
        orphaned = self.stop_reason == _ORPHANED
        _unlink_all(self.ledger.release_all() + self.deferred_unlinks)
        if orphaned:  # the launcher cannot sweep any more: every segment of the launch goes now
            sweep(self.config.launch_id)
        linger = 0 if orphaned else _LINGER_MS  # with the launcher gone, nobody is left to read
        if self.kv_events is not None:
            self.kv_events.close(min(linger, 200))  # an absent subscriber must not hold the exit up
        for sock in self.models:
            sock.send(Shutdown(self.stop_reason or "scheduler exiting"))
            sock.close(linger_ms=linger)  # the linger lets Shutdown out before ctx.term() returns
        self.inbound.close()
        self.frontend.close(linger_ms=linger)
        for tok in self.tokenizers:
            tok.close()  # only stats go there: nothing worth waiting for a missing peer
        self.ctx.term()
        if orphaned:
            # Again, for a tokenizer write that raced its SIGKILL, then the sockets' directory.
            sweep(self.config.launch_id)
            cleanup_launch_dir(self.config.launch_id)


def run_scheduler(config: ServerConfig, replica: int = 0) -> None:
    """Entry point of the scheduler process; returns (exit 0) after Shutdown or SIGTERM."""
    log = setup_child(f"glimpse.scheduler[{replica}]" if config.dp_size > 1 else "glimpse.scheduler", config.log_level)
    sched = Scheduler(config, log, replica)
    try:
        if sched.wait_for_models():
            sched.run()
        log.info("exiting: %s", sched.stop_reason)
    except Exception:
        log.exception("scheduler failed")
        raise SystemExit(1) from None
    finally:
        sched.close()
