"""The scheduler's state and the housekeeping every part of its loop shares (workers/scheduler/process.py runs
the loop; intake.py takes requests and aborts in, results.py turns step results into outputs). ``SchedulerBase``
holds the sockets, the scheduling core, the text streams of live choices, the shm ledger and the counters the
stats read; its methods unlink shm names (deferred while a step in flight may still read pixels), fail a request
to the frontend and send the periodic stats.
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
from ipc.control import RequestFailed
from ipc.inbound import SchedulerInbound
from ipc.shm import ShmSegment
from ipc.stats import EncoderStats, WorkerStats
from ipc.steps import StepPlan
from workers.common.detokenizer import TextStream
from workers.common.full_collections import FullCollections
from workers.common.proc import GcWatch
from workers.common.reasoning import Split
from workers.common.reasoning_channels import marker_ids
from workers.common.reasoning_markers import PARSERS
from workers.common.step_trace import StepTrace
from workers.common.tool_gemma import keep_ids
from workers.common.tool_output import ToolOutput
from workers.config import ServerConfig
from workers.engine.core.scheduler import SchedulerCore, Sequence
from workers.scheduler.encoders import EncoderPool
from workers.scheduler.kv_events import KVEventRecorder
from workers.scheduler.logprobs import LogprobRenderer, PromptLogprobBook
from workers.scheduler.shm_ledger import ShmLedger
from workers.scheduler.stats import LOG_STATS_INTERVAL_S, STATS_INTERVAL_S, snapshot

LINGER_MS = 2_000
ORPHANED = "the launcher is gone"


def unlink_all(names: list[str]) -> None:
    for name in names:
        ShmSegment.unlink(name)


class SchedulerBase:
    """What the scheduler holds, and its shared housekeeping."""

    def __init__(self, config: ServerConfig, log: logging.Logger, replica: int = 0) -> None:
        self.config = config
        self.log = log
        self.replica = replica  # --dp: this scheduler's replica, whose model workers are replica * tp + rank
        ctx, lid = new_context(), config.launch_id
        self.ctx = ctx
        self.inbound = endpoints.pull(ctx, lid, endpoints.SCHEDULER, replica)
        tp, tokenizers = config.engine.tp_size, config.tokenizer_workers
        self.models = [endpoints.push(ctx, lid, endpoints.MODEL, replica * tp + r) for r in range(tp)]
        # --encoder-workers: this replica's are replica * enc .. replica * enc + enc - 1, or all with --shared-encoders.
        mine = config.replica_encoders(replica)
        self.encoders = [endpoints.push(ctx, lid, endpoints.ENCODER, i) for i in mine]
        self.encoding = EncoderPool(self.encoders, first=mine[0] if mine else 0, replica=replica)
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
        self.gemma_tool_ids = keep_ids(self.tokenizer)  # Gemma 4's call tags and quote, kept in such requests' text
        self.reasoning: dict[str, Split] = {}  # --reasoning-parser: each chat choice's split
        # A parser whose markers are special tokens splits on their ids (the launcher checked they are there).
        parser = PARSERS.get(config.reasoning_parser)
        self.reasoning_marker_ids = marker_ids(self.tokenizer, parser) if parser and parser.special else None
        # Replicas split the budget, so together they keep to it (tokenizers add their reports up). Each counts
        # only its own requests' names: an image two replicas hold is counted twice, never unlinked early.
        budget = config.shm_budget_bytes // max(1, config.dp_size)
        self.ledger = ShmLedger(budget, config.shm_retain_fraction, config.shm_retain_idle_s)
        self.kv_events: KVEventRecorder | None = None
        self.parent = os.getppid()  # the launcher; a change means it died and this process was re-parented
        self.worker_stats: dict[int, WorkerStats] = {}
        self.encoder_stats: dict[int, EncoderStats] = {}  # --encoder-workers: each one's latest counters
        self.gpu_peak = self.gpu_idle = 0  # bytes; the peak restarts whenever work starts from idle
        self.deferred_unlinks: list[str] = []
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.early: list[SchedulerInbound] = []  # arrived before the core existed
        self.stop_reason: str | None = None
        self.steps = self.generated_tokens = self.prompt_tokens = self.images_encoded = self.vit_batches = 0
        self.steps_ahead = 0
        self.gc: GcWatch  # started by wait_for_models once start-up is over (its collections are not serving's)
        self.full_gc: FullCollections  # with it: the oldest generation collected when idle (full_collections.py)
        # Encoded StepPlan sizes (pointers only, so they track tokens and image counts, not pixels).
        self.plan_bytes = {"last": 0, "max": 0, "total": 0}
        self.next_stats = self.next_log = 0.0

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

    def _busy_names(self) -> set[str]:
        """Names something may still map: pixels an encoder worker has in hand, and landing segments a step in
        flight imports (its workers map them when they take the plan)."""
        busy = self.encoding.busy_names() if self.encoding else set()
        busy.update(imp.embeddings.name for plan in self.in_flight for imp in plan.mm_import)
        return busy

    def unlink(self, names: list[str]) -> None:
        """Unlink segments ``names`` (and release CUDA pool landings among them), deferred while something may
        still map one."""
        if not names:
            return
        if self._reading_pixels():
            # The step now running may still read these names (an encode job can point at a name of
            # an image another request shares): unlink once it is back.
            self.deferred_unlinks.extend(names)
            return
        busy = self._busy_names()
        # CUDA pool landings go back to their encoders (EncodeRelease), the rest are segments to unlink.
        gone = self.encoding.release([n for n in names if n not in busy])
        unlink_all(gone)
        self.ledger.unlinked(gone)  # landing segments leave the shm budget only now
        self.deferred_unlinks.extend(n for n in names if n in busy)

    def _fail(self, rid: str, status: int, message: str, code: str | None = None) -> None:
        self.log.info("request %s failed (%d): %s", rid, status, message)
        kind = "server_error" if status >= 500 else "invalid_request_error"  # OpenAI's error types
        self.frontend.send(RequestFailed(rid, status, message, type=kind, code=code))

    def _flush_unlinks(self) -> None:
        if self._reading_pixels() or not self.deferred_unlinks:
            return
        names, self.deferred_unlinks = self.deferred_unlinks, []
        self.unlink(names)
