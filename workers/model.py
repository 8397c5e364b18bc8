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
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import torch

from ipc.channels import PullSocket, PushSocket, new_context
from ipc.launch import ipc_address
from ipc.messages import (
    EncodeItem,
    ModelInbound,
    ProcessReady,
    SchedulerInbound,
    Shutdown,
    StepPlan,
    WorkerFailed,
)
from ipc.shm import ShmSegment
from server.config import ServerConfig
from workers.engine.layers import TPGroup
from workers.engine.model_runner import ModelRunner

# Short receive timeout: the loop wakes up to notice SIGTERM even when no plan comes.
_POLL_MS = 200
# Enough for the last StepResult / WorkerFailed to reach the scheduler before the process exits.
_LINGER_MS = 2_000


def _configure_logging(tag: str, level: str) -> logging.Logger:
    """Every line carries the role and rank, whichever logger (ours, the engine's, a library's) wrote it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {tag} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return logging.getLogger(tag)


@dataclass
class PixelReader:
    """The runner's pixel source: maps one image's segment, returns its tensor, unmaps.

    The returned view keeps the mapping alive until the runner has concatenated the batch, then
    the pages are released; so at most one step's images are mapped at a time.
    """

    reads: int = 0
    bytes_read: int = 0

    def __call__(self, item: EncodeItem) -> torch.Tensor:
        ref = item.pixels
        if ref is None:
            raise ValueError(f"image {item.hash.hex()[:16]} has no shared-memory pixels in the plan")
        with ShmSegment.attach(ref) as seg:
            pixels = seg.tensor(ref)
        self.reads += 1
        self.bytes_read += ref.nbytes
        return pixels


def _tp_group(config: ServerConfig, rank: int) -> TPGroup | None:
    if config.engine.tp_size == 1:
        return None
    # torch.distributed initialisation (rendezvous address, NCCL group) belongs to the TP issue;
    # refusing here beats silently running sharded weights without their all-reduce.
    raise NotImplementedError(f"tensor parallelism (tp_size={config.engine.tp_size}) is not wired up yet")


def run_model_worker(config: ServerConfig, rank: int) -> None:
    """Entry point of model worker ``rank``: load, announce readiness, serve plans until Shutdown."""
    log = _configure_logging(f"glimpse.model[{rank}]", config.log_level)
    stop_requested = False

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        nonlocal stop_requested
        stop_requested = True

    # Ctrl-C reaches the whole process group; the launcher decides how to stop, then sends Shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)

    ctx = new_context()
    # Bind before the (slow) model load so plans sent right after our ready ack find the endpoint.
    inbound = PullSocket[ModelInbound](ctx, ipc_address(config.launch_id, f"model{rank}"), ModelInbound, bind=True)
    to_sched = PushSocket[SchedulerInbound](ctx, ipc_address(config.launch_id, "sched"), SchedulerInbound, bind=False)
    reader = PixelReader()
    try:
        t0 = time.monotonic()
        runner = ModelRunner(config.engine, pixel_source=reader, tp=_tp_group(config, rank))
        log.info(
            "loaded %s in %.1fs: %d KV blocks of %d tokens, dtype %s, device %s",
            config.engine.model, time.monotonic() - t0, runner.num_blocks, config.engine.block_size,
            runner.dtype, runner.device,
        )
        to_sched.send(ProcessReady(role="model", index=rank, pid=os.getpid(), num_kv_blocks=runner.num_blocks))
        _serve(runner, reader, rank, inbound, to_sched, log, lambda: stop_requested)
    except Exception:
        log.exception("model worker failed")
        raise SystemExit(1) from None
    finally:
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
    stop_requested: Callable[[], bool],
) -> None:
    while not stop_requested():
        msg = inbound.recv(_POLL_MS)
        if msg is None:
            continue
        if isinstance(msg, Shutdown):
            log.info("shutdown requested%s", f": {msg.reason}" if msg.reason else "")
            return
        _run_step(runner, reader, rank, msg, to_sched, log)
    log.info("SIGTERM: exiting")


def _run_step(
    runner: ModelRunner,
    reader: PixelReader,
    rank: int,
    plan: StepPlan,
    to_sched: PushSocket[SchedulerInbound],
    log: logging.Logger,
) -> None:
    reads, nbytes = reader.reads, reader.bytes_read
    t0 = time.perf_counter()
    try:
        result = runner.execute(plan)
    except Exception as exc:
        # One bad step (a vanished segment, a shape the kernel rejects) fails only its requests:
        # the scheduler aborts them and the worker keeps serving the rest.
        log.exception("step %d failed", plan.step_id)
        to_sched.send(WorkerFailed(rank=rank, step_id=plan.step_id, message=f"{type(exc).__name__}: {exc}"))
        return
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "step %d: %d chunks, %d images encoded in %d ViT calls, %d pixel reads (%d bytes), %.1f ms",
            plan.step_id, len(plan.chunks), result.images_encoded, result.vit_calls,
            reader.reads - reads, reader.bytes_read - nbytes, (time.perf_counter() - t0) * 1e3,
        )
    # Every rank runs the step (to keep KV and embedding stores identical); rank 0 alone samples.
    if rank == 0:
        to_sched.send(result)
