"""Model worker process (one per TP rank): runs the scheduler's ``StepPlan``s on the engine's
``ModelRunner`` and reports sampled tokens back.

Pixels never travel on a socket: a plan's encode jobs carry ``ShmRef`` pointers, and this worker
maps only the segments of the images it is asked to encode in that step, read-only, and lets go of
the mapping as soon as the pixels are copied into the ViT batch. It never unlinks a segment (the
scheduler owns that).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ipc import endpoints
from ipc.channels import PullSocket, PushSocket, new_context
from ipc.control import ProcessReady, Shutdown
from ipc.inbound import ModelInbound, SchedulerInbound
from ipc.shm import ShmSegment
from ipc.stats import WorkerStats
from ipc.steps import EncodeItem, StepPlan, WorkerFailed
from workers.common.full_collections import FullCollections
from workers.common.memory import IdleTrim, trim_memory
from workers.common.proc import GcWatch, freeze_heap, setup_child, startup_gc_summary
from workers.config import ServerConfig
from workers.engine.config import EngineConfig
from workers.engine.kernels import fla_tuning
from workers.engine.layers import vit_graphs
from workers.engine.layers.linear import TPGroup
from workers.engine.runner.model_runner import Launched, ModelRunner
from workers.model import mem_diag

# Enough for the last StepResult / WorkerFailed to reach the scheduler before the process exits.
_LINGER_MS = 2_000
# After this long without a plan, following work, the heap's freed memory goes back to the OS (malloc_trim): under
# load the allocator reuses it, but a worker that served a burst would otherwise keep its peak RSS while idle.
TRIM_IDLE_S = 10.0
_IDLE_POLL_MS = 250  # while idle with a trim or a full collection pending: how often to look at the clock


@dataclass
class PixelReader:
    """The runner's pixel source: maps one image's segment, returns its tensor, unmaps.

    The returned view keeps the mapping alive until the runner has concatenated the batch, then
    the pages are released; so at most one step's images are mapped at a time.
    """

    reads: int = 0
    bytes_read: int = 0
    steps: int = 0
    broadcast_s_sum: float = 0.0
    broadcast_s_max: float = 0.0

    def broadcast(self, seconds: float) -> None:
        """Record how long a plan took from the scheduler's encode to this rank's decode."""
        self.steps += 1
        self.broadcast_s_sum += seconds
        self.broadcast_s_max = max(self.broadcast_s_max, seconds)

    def __call__(self, item: EncodeItem) -> torch.Tensor:
        ref = item.pixels
        if ref is None:
            raise ValueError(f"image {item.hash.hex()[:16]} has no shared-memory pixels in the plan")
        with ShmSegment.attach(ref) as seg:
            pixels = seg.tensor(ref)
        self.reads += 1
        self.bytes_read += ref.nbytes
        return pixels


def _init_tp(config: ServerConfig, index: int) -> tuple[TPGroup | None, EngineConfig]:
    """Join the TP group of this worker's replica (gloo on CPU, NCCL on GPU) and pick its device: worker
    ``index`` is rank ``index % tp`` of replica ``index // tp`` and owns GPU ``index``."""
    engine = config.engine
    size = engine.tp_size
    replica, rank = divmod(index, size)
    if engine.device.startswith("cuda"):
        engine = replace(engine, device=f"cuda:{index}")
        torch.cuda.set_device(index)
    if size == 1:
        return None, engine
    backend = "nccl" if engine.device.startswith("cuda") else "gloo"
    if backend == "gloo":
        # All ranks share this host: keep gloo on loopback rather than whatever the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=config.ready_timeout_s)
    # The rendezvous store is served by the launcher (host_rendezvous), which bound its port before any
    # rank started: no port to race for, and nothing on disk for ranks to tear down at exit.
    store: Any = dist.TCPStore("127.0.0.1", config.dist_port, is_master=False, timeout=timeout)
    if config.dp_size > 1:  # one store for the launch; each replica's group rendezvouses under its own prefix
        store = dist.PrefixStore(f"replica{replica}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return TPGroup(rank=rank, size=size), engine


def host_rendezvous() -> tuple[Any, int]:
    """Serve torch.distributed's key-value store on a loopback port the OS picks; returns (store, port).
    The caller keeps ``store`` alive for as long as ranks may join."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, int(store.port)


def run_model_worker(config: ServerConfig, index: int) -> None:
    """Entry point of model worker ``index`` (rank ``index % tp`` of replica ``index // tp``): load, announce
    readiness, serve plans until Shutdown."""
    replica, rank = divmod(index, config.engine.tp_size)
    log = setup_child(f"glimpse.model[{index}]", config.log_level)
    ctx = new_context()
    # Bind before the (slow) model load so plans sent right after our ready ack find the endpoint.
    inbound = endpoints.pull(ctx, config.launch_id, endpoints.MODEL, index)
    to_sched = endpoints.push(ctx, config.launch_id, endpoints.SCHEDULER, replica)
    reader = PixelReader()
    runner: ModelRunner | None = None
    try:
        t0 = time.monotonic()
        tp, engine = _init_tp(config, index)
        if config.encoder_workers:  # encoder workers run the tower: this worker builds none and imports their entries
            engine = replace(engine, vision_tower=False)
        runner = ModelRunner(engine, pixel_source=reader, tp=tp)
        runner.counters.keep_per_step = False  # a serving worker's steps never end: keep no list of them
        if config.encoder_transport == "nixl":  # the agent (~0.5 s to make) before the first image, not in its step
            runner.landings.nixl.start()
        log.info(
            "loaded %s in %.1fs: %d KV blocks of %d tokens, dtype %s, device %s, tp %d/%d",
            engine.model,
            time.monotonic() - t0,
            runner.num_blocks,
            engine.block_size,
            runner.dtype,
            runner.device,
            rank,
            engine.tp_size,
        )
        fla_tuning.dump_if_asked()
        if (collections := startup_gc_summary()) is not None:
            log.info("start-up garbage collections: %s", collections)
        gc_watch = GcWatch(frozen=freeze_heap(log))  # pauses while serving, not the freeze's own collection
        mem_diag.start(index, lambda: _books(runner))
        to_sched.send(
            ProcessReady(
                role="model", index=rank, pid=os.getpid(), num_kv_blocks=runner.num_blocks,
                num_state_slots=runner.num_state_slots,
                num_window_blocks=runner.num_window_blocks,
                num_kv_host_slots=runner.host_kv.num_slots if runner.host_kv is not None else 0,
            )  # fmt: skip
        )
        _serve(runner, reader, rank, inbound, to_sched, log, gc_watch)
    except Exception:
        log.exception("model worker failed")
        raise SystemExit(1) from None
    finally:
        if runner is not None:  # encoder workers' CUDA pools unmapped before the encoders exit and free them
            runner.landings.close()
        inbound.close()
        to_sched.close(linger_ms=_LINGER_MS)
        ctx.term()
    log.info("exiting: %d pixel reads, %d bytes read", reader.reads, reader.bytes_read)


def _serve(
    runner: ModelRunner,
    reader: PixelReader,
    rank: int,
    inbound: PullSocket[ModelInbound],
    to_sched: PushSocket[SchedulerInbound],
    log: logging.Logger,
    gc_watch: GcWatch,
) -> None:
    """Run plans as they come; report each step once its GPU work is done.

    A step's result is read only when the GPU has finished it, and while it runs this loop takes the next plan
    if one comes: a step planned ahead (asynchronous scheduling) is then queued behind the running one before
    the running one is reported, so the GPU goes from one step to the next without waiting on the host. The
    running one is reported as soon as it is done, from inside that launch too (runner.launch_poll: between
    layers), not after the whole launch.
    The wait spins on the step's event and the socket (a CUDA sync spins as well)."""
    running: deque[Launched] = deque()
    trim = IdleTrim(TRIM_IDLE_S, big=0, huge=1 << 62)  # any step counts as work; none is big enough to trim at once
    full = FullCollections(gc_watch)  # the oldest generation collected when idle or right after a launch

    def report_finished() -> None:
        """Report the steps at the head of ``running`` whose GPU work is done (also from inside a launch:
        runner.launch_poll)."""
        while running and running[0].done():
            _report(runner, reader, rank, running.popleft(), to_sched, gc_watch)
            now = time.monotonic()
            trim.finished(1, now, not running)
            full.worked(now, not running)

    try:
        while True:
            waiting_since = time.monotonic()
            if running:
                if running[0].done():
                    report_finished()
                    continue
                msg = inbound.recv(0)
                if msg is None:
                    continue
                waiting_since = 0.0  # polled for while a step ran: it is taken as it lands
            elif trim.pending or full.pending:  # wake up now and then: has the worker been idle long enough?
                msg = inbound.recv(_IDLE_POLL_MS)
                if msg is None:
                    now = time.monotonic()
                    if trim.due(now, True):
                        trim_memory()
                    if full.poll(now, True):
                        _send_stats(runner, reader, rank, to_sched, gc_watch)  # the collection shows without a step
                    continue
            else:
                msg = inbound.recv()
            if isinstance(msg, Shutdown):
                log.info("shutdown requested%s", f": {msg.reason}" if msg.reason else "")
                return
            # Transfer + decode only: a plan that arrived while this rank was still finishing the last
            # step waited in the socket queue, which is compute, not broadcast.
            reader.broadcast(time.monotonic() - max(msg.sent_at, waiting_since))
            with runner.launch_poll.calling(report_finished):  # steps before it are reported as they finish
                launched = _launch(runner, rank, msg, to_sched, log)
            if launched is not None:
                running.append(launched)
                full.poll(time.monotonic(), False)  # overdue under load: now, with the GPU's queue just filled
    finally:
        full.close()  # a test's in-process worker leaves the interpreter's schedule as it found it


def _launch(
    runner: ModelRunner, rank: int, plan: StepPlan, to_sched: PushSocket[SchedulerInbound], log: logging.Logger
) -> Launched | None:
    try:
        return runner.launch(plan)
    except Exception as exc:
        log.exception("step %d failed", plan.step_id)
        if runner.tp.size > 1:
            # Peers may be blocked in a collective this rank will never join: only a restart is
            # safe, and the launcher turns this exit into failed requests and a clean stop.
            raise
        # With one rank, a bad step (a vanished segment, a shape the kernel rejects) fails only its
        # requests: the scheduler aborts them and the worker keeps serving the rest.
        to_sched.send(WorkerFailed(rank=rank, step_id=plan.step_id, message=f"{type(exc).__name__}: {exc}"))
        return None


def _report(
    runner: ModelRunner,
    reader: PixelReader,
    rank: int,
    launched: Launched,
    to_sched: PushSocket[SchedulerInbound],
    gc_watch: GcWatch,
) -> None:
    # Every rank runs the step (to keep KV and embedding stores identical); rank 0 alone samples. The result goes
    # first: the scheduler plans the next step from it, and the stats below cost ~0.3-0.5 ms a step (allocator
    # queries) that would otherwise sit between the GPU finishing and the next plan.
    result = launched.result()
    if rank == 0:
        to_sched.send(result)
    _send_stats(runner, reader, rank, to_sched, gc_watch)


def _send_stats(
    runner: ModelRunner, reader: PixelReader, rank: int, to_sched: PushSocket[SchedulerInbound], gc_watch: GcWatch
) -> None:
    # Every step: a few dozen bytes, and the scheduler's stats then show each rank's broadcast times
    # and the step's peak GPU memory (reset each step, so the scheduler can take a max per request).
    peak = allocated = 0
    if runner.device.type == "cuda":
        peak, allocated = torch.cuda.max_memory_allocated(runner.device), torch.cuda.memory_allocated(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
    c = runner.counters
    to_sched.send(
        WorkerStats(
            rank, reader.reads, reader.bytes_read, c.images_encoded, c.vit_calls,
            reader.steps, reader.broadcast_s_sum, reader.broadcast_s_max, peak, allocated,
            gc_watch.collections, gc_watch.pause_s_max, gc_watch.frozen, gc_watch.full, gc_watch.pause_s_sum,
            runner.weight_bytes, runner.vision_weight_bytes, vit_graphs.replays(runner.vision), runner.ahead.images,
            runner.landings.nixl.reads, runner.landings.nixl.bytes_read, ahead_waits=runner.ahead.waits,
            gc_idle_full=gc_watch.idle_full,
        )
    )


def _books(runner: ModelRunner) -> dict[str, int]:
    """Sizes of the runner's per-request and per-step books, for GLIMPSE_MEM_DIAG (read from another thread:
    a dict's len is atomic under the GIL)."""
    sampler = runner.sampler
    books = {"seqs": len(runner.seqs), "store": len(runner.store), "store_bytes": runner.store.nbytes,
             "generators": len(sampler._generators), "generated": len(sampler._generated),
             "per_step": len(runner.counters.encoded_per_step),
             "vit_plan_bytes": runner.vision.call_plans.bytes if runner.vision is not None else 0}
    if runner.device.type == "cuda":  # pinned staging buffers: torch caches them by size and never frees them
        host = torch.cuda.host_memory_stats()
        books["pinned_bytes"] = int(host.get("allocated_bytes.current", 0))  # owned: in use + cached
        books["pinned_active_bytes"] = int(host.get("active_bytes.current", 0))
    return books
