"""Scheduler process: admission, continuous batching and detokenization between tokenizers, model
workers and frontend. One loop, never blocked on the model: it polls its PULL socket (requests,
aborts, step results), keeps one step in flight, and plans the next step the moment a result lands;
with asynchronous scheduling the next step also goes out while the one before it runs (see
``SchedulerCore.schedule(ahead=True)``). A plan is encoded once and the same bytes go to every TP rank;
plans carry shm pointers, never pixels, and this process never maps a segment. It is the only process
that unlinks segments: a request's names go when the request finishes, fails or is aborted (see ``_release``), and retained
ones after ``shm_retain_idle_s`` unused. If the launcher dies (SIGKILL, OOM) the scheduler notices
within a loop turn and removes every segment and the socket directory of the launch before it
exits: the other children die with the launcher, and nobody else would.

This module is the lifecycle (start-up, the loop, planning, shutdown); the class is built up in layers, each in
its own module: base.py (state, unlinking, stats), intake.py (requests and aborts in), results.py (step results
out as outputs).
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec

from ipc.channels import PushSocket
from ipc.control import AbortRequest, ProcessReady, Shutdown
from ipc.encode import EncodeDone, EncodeFailed
from ipc.inbound import SchedulerInbound
from ipc.landing import is_pool_landing
from ipc.launch import cleanup_launch_dir
from ipc.prompts import MediaFailed, MediaReady, TokenizedRequest
from ipc.shm import sweep
from ipc.stats import EncoderStats, WorkerStats
from ipc.steps import StepResult, WorkerFailed
from workers.common.full_collections import FullCollections
from workers.common.proc import GcWatch, freeze_heap, setup_child
from workers.config import ServerConfig
from workers.engine.core.scheduler import SchedulerCore
from workers.scheduler.base import LINGER_MS, ORPHANED, unlink_all
from workers.scheduler.encoding import EncodeAnswers
from workers.scheduler.kv_events import KVEventRecorder

_MAX_DRAIN = 256  # messages handled per loop turn before the next step is planned


def build_core(
    config: ServerConfig, num_blocks: int, state_slots: int = 0, window_blocks: int = 0, kv_host_slots: int = 0
) -> SchedulerCore:
    """The scheduling core for ``config`` with ``num_blocks`` KV blocks, for a hybrid model ``state_slots``
    linear-attention state slots, for a family with sliding-window layers ``window_blocks`` blocks of their own
    pool, and ``kv_host_slots`` blocks of the prefix cache's host tier (each the smallest rank's count)."""
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
        mm_host_cache_bytes=eng.host_cache_bytes(),
        embedding_bytes_per_token=info.embedding_bytes_per_token(eng.torch_dtype()),
        eos_token_ids=info.eos_token_ids,
        mm_cache_mode=eng.mm_cache_mode,
        enable_prefix_caching=eng.enable_prefix_caching,
        lone_prefill_tokens=eng.lone_prefill_tokens,
        decode_step_image_tokens=eng.decode_step_image_tokens,
        encode_token_cost=eng.encode_token_cost,
        encode_ahead_tokens=eng.encode_ahead_tokens,
        state_slots=state_slots,
        state_snapshot_every=eng.state_snapshot_every,
        whole_images=info.bidirectional_images,
        window=info.window,
        window_blocks=window_blocks,
        kv_host_slots=kv_host_slots,
        remote_encodes=config.encoder_workers > 0,
    )


class Scheduler(EncodeAnswers):
    """One replica's scheduler: start-up (every rank's KV blocks), the loop, and shutdown."""

    def wait_for_models(self) -> bool:
        """Collect ProcessReady from every rank (and encoder worker) and build the core; False if told to stop first."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        blocks: dict[int, int] = {}
        slots: dict[int, int] = {}
        window_blocks: dict[int, int] = {}
        host_slots: dict[int, int] = {}
        encoders: set[int] = set()
        while len(blocks) < len(self.models) or len(encoders) < len(self.encoders):
            if self.stop_reason is not None or self._orphaned():
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"model ranks other than {sorted(blocks)} (or encoders other than {sorted(encoders)}) "
                                   "never got ready")
            msg = self.inbound.recv(int(min(left, 0.2) * 1000))
            if msg is None:
                continue
            if isinstance(msg, ProcessReady) and msg.role == "model":
                blocks[msg.index] = msg.num_kv_blocks
                slots[msg.index] = msg.num_state_slots
                window_blocks[msg.index] = msg.num_window_blocks
                host_slots[msg.index] = msg.num_kv_host_slots
                self.log.info("model rank %d ready: %d KV blocks", msg.index, msg.num_kv_blocks)
            elif isinstance(msg, ProcessReady) and msg.role == "encoder":
                encoders.add(msg.index)
            elif isinstance(msg, Shutdown):
                self.stop_reason = msg.reason or "shutdown"
            else:
                self.early.append(msg)
        # Ranks may have sized their caches from different free memory: the smallest one binds all.
        self.core = build_core(self.config, min(blocks.values()), min(slots.values()), min(window_blocks.values()),
                               min(host_slots.values()))
        self.core.on_finished = self._release
        if self.core.remote is not None:
            self.core.remote.on_unlink = self.unlink  # landing segments no plan will import
        if (events := KVEventRecorder.open(self.ctx, self.config, self.replica)) is not None:
            self.kv_events = events.attach(self.core)
            self.log.info("KV-cache events go to the launcher's publisher (%s)", self.config.kv_events_endpoint)
        self.gc = GcWatch(frozen=freeze_heap(self.log))
        self.full_gc = FullCollections(self.gc)
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
                    self.full_gc.worked(time.monotonic(), not self.in_flight)
                    break
            if len(self.in_flight) < 2:
                self._schedule()
            if self.kv_events is not None:
                self.kv_events.flush()
            self.send_stats()
            self._orphaned()
            # Idle (nothing planned or running), or overdue with the next step just sent to the workers.
            self.full_gc.poll(time.monotonic(), not self.in_flight and not self.core.has_work())

    def handle(self, msg: SchedulerInbound) -> None:
        match msg:
            case StepResult():
                self._on_result(msg)
            case TokenizedRequest():
                self._on_request(msg)
            case AbortRequest(rid=rid):
                self._on_abort(rid)
            case MediaReady(rid=rid, hashes=hashes):
                if self.trace.enabled:
                    self.trace.event("media", rid=rid, images=len(hashes))
                published, gone = self.ledger.publish(rid, hashes)
                self.core.media_ready(rid, published)
                self.unlink(gone)
                self._dispatch_encodes()  # a running request's new pixels go to an encoder at once
            case MediaFailed(rid=rid):
                self.unlink(self.ledger.pending_failed(rid))
                self._on_abort(rid)
            case WorkerFailed():
                self._on_worker_failed(msg)
            case WorkerStats(rank=rank):
                self.worker_stats[rank] = msg
                self.gpu_peak = max(self.gpu_peak, msg.gpu_step_peak_bytes)
            case EncodeDone():
                self._on_encode_done(msg)
            case EncodeFailed():
                self._on_encode_failed(msg)
            case EncoderStats(index=index):
                self.encoder_stats[index] = msg
            case Shutdown(reason=reason):
                self.stop_reason = reason or "shutdown"
            case _:
                self.log.warning("unexpected %s", type(msg).__name__)

    def _schedule(self) -> None:
        try:
            self._plan_steps()
        finally:
            self._dispatch_encodes()  # admitted requests' images, even when no step could be planned

    def _plan_steps(self) -> None:
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

    def _orphaned(self) -> bool:
        if os.getppid() == self.parent:
            return False
        if self.stop_reason != ORPHANED:
            self.log.error("the launcher (pid %d) is gone; removing the launch's shared memory and exiting", self.parent)
        self.stop_reason = ORPHANED
        return True

    def close(self) -> None:
        """Unlink every live request's names, tell the model workers to exit, close the sockets."""
        orphaned = self.stop_reason == ORPHANED
        landing = [imp.embeddings.name for plan in self.in_flight for imp in plan.mm_import]
        core: SchedulerCore | None = getattr(self, "core", None)  # (None: stopped before the models were ready)
        if core is not None and core.remote is not None:
            landing += core.remote.release_all()
        # Pool landings are not unlinked: the pools go with their encoders, which this Shutdown ends (a shared encoder's
        # once every replica's scheduler sent its own).
        unlink_all([n for n in self.ledger.release_all() + self.deferred_unlinks + landing if not is_pool_landing(n)])
        if orphaned:  # the launcher cannot sweep any more: every segment of the launch goes now
            sweep(self.config.launch_id)
        linger = 0 if orphaned else LINGER_MS  # with the launcher gone, nobody is left to read
        if self.kv_events is not None:
            self.kv_events.close(min(linger, 200))  # an absent subscriber must not hold the exit up
        children: list[PushSocket[Any]] = [*self.models, *self.encoders]
        for sock in children:
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
