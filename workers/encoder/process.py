"""Encoder worker process (``--encoder-workers``; N per replica): runs the vision tower alone on the requests its
scheduler sends and answers each with a landing segment of embeddings (ipc/encode.py).

Like a model worker it only attaches and reads pixel segments and never unlinks one; the landing segments it
creates are the scheduler's from the moment ``EncodeDone`` names them (the scheduler unlinks them, and the
launcher's sweep takes any an encoder wrote but never reported). On CUDA it lands entries in its own GPU pool when
there is room (cuda_landing.py); a range stays taken until the scheduler's ``EncodeRelease`` frees it, and the pool
goes with the process. It dies with the launcher (PDEATHSIG), and the
launcher treats its death like a model worker's: in-flight requests fail and the server stops.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from ipc import endpoints
from ipc.channels import PullSocket, PushSocket, new_context
from ipc.control import ProcessReady, Shutdown
from ipc.encode import EncodeRelease, EncodeRequest
from ipc.inbound import EncoderInbound, SchedulerInbound
from ipc.stats import EncoderStats
from workers.common.proc import freeze_heap, setup_child
from workers.config import ServerConfig
from workers.encoder.cuda_landing import open_pool
from workers.encoder.tower import EncoderTower
from workers.engine.runner.batching import patches
from workers.engine.runner.model_runner import CUDA_HOST_THREADS

# Enough for the last answers to reach the scheduler before the process exits.
_LINGER_MS = 2_000
# Requests already queued are encoded together, up to this many ViT calls' worth of patches: more would only
# hold back the answers of the first ones.
_BATCH_CALLS = 4


def run_encoder_worker(config: ServerConfig, index: int) -> None:
    """Entry point of encoder worker ``index`` (number ``index % encoder_workers`` of replica
    ``index // encoder_workers``): load the tower, announce readiness, encode until Shutdown."""
    replica = index // max(1, config.encoder_workers)
    log = setup_child(f"glimpse.encoder[{index}]", config.log_level)
    ctx = new_context()
    # Bound before the (slow) load, so requests sent right after the ready ack find the endpoint.
    inbound = endpoints.pull(ctx, config.launch_id, endpoints.ENCODER, index)
    to_sched = endpoints.push(ctx, config.launch_id, endpoints.SCHEDULER, replica)
    tower: EncoderTower | None = None
    try:
        started = time.monotonic()
        device = torch.device(config.encoder_device(index))
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # As in a CUDA model worker: the host side is staging copies, and a full OpenMP pool only spins.
            torch.set_num_threads(min(torch.get_num_threads(), CUDA_HOST_THREADS))
        tower = EncoderTower(config.engine, config.launch_id, index, device)
        tower.pool = open_pool(index, device, config.encoder_landing_mb << 20, config.lm_devices(replica))
        log.info("vision tower of %s loaded in %.1fs on %s, %s", config.engine.model, time.monotonic() - started,
                 device, tower.dtype)
        freeze_heap(log)
        to_sched.send(ProcessReady(role="encoder", index=index, pid=os.getpid()))
        _serve(tower, inbound, to_sched, log)
    except Exception:
        log.exception("encoder worker failed")
        raise SystemExit(1) from None
    finally:
        inbound.close()
        to_sched.close(linger_ms=_LINGER_MS)
        ctx.term()
    if tower is not None:
        log.info("exiting: %d jobs, %d images encoded", tower.jobs, tower.counters.images_encoded)


def _serve(
    tower: EncoderTower, inbound: PullSocket[EncoderInbound], to_sched: PushSocket[SchedulerInbound],
    log: logging.Logger,
) -> None:
    """Encode requests as they come, each batch made of what is queued; answer, then report the counters."""
    budget = _BATCH_CALLS * tower.engine.vit_max_patches
    while True:
        msg: EncoderInbound | None = inbound.recv()
        batch: list[EncodeRequest] = []
        stop: Shutdown | None = None
        total = released = 0
        while msg is not None:
            if isinstance(msg, Shutdown):
                stop = msg
                break
            if isinstance(msg, EncodeRelease):  # ranges free before this batch lands: more of it fits the pool
                if tower.pool is not None:
                    released += tower.pool.release(msg.names)
                msg = inbound.recv(0)
                continue
            batch.append(msg)
            total += sum(patches(item.grid) for item in msg.items)
            if total >= budget:
                break
            msg = inbound.recv(0)
        if batch:
            for answer in tower.run(batch):
                to_sched.send(answer)
        if batch or released:  # the counters, and the pool's use now
            to_sched.send(_stats(tower))
        if stop is not None:
            log.info("shutdown requested%s", f": {stop.reason}" if stop.reason else "")
            return


def _stats(tower: EncoderTower) -> EncoderStats:
    c, pool = tower.counters, tower.pool
    return EncoderStats(
        tower.index, tower.jobs, c.images_encoded, c.vit_calls, tower.failed, tower.pixels.reads,
        tower.pixels.bytes_read, tower.landing_bytes,
        landing_pool_bytes=pool.size if pool is not None else 0,
        landing_pool_used_bytes=pool.used_bytes if pool is not None else 0,
        cuda_landings=tower.cuda_landings, shm_landings=tower.shm_landings,
    )  # fmt: skip
