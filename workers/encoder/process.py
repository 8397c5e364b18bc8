"""Encoder worker process (``--encoder-workers``; N per replica, or N for the launch with ``--shared-encoders``): runs
the vision tower alone on the requests its schedulers send and answers each with a landing segment of embeddings
(ipc/encode.py), to the scheduler of the replica the request names.

A shared encoder holds a push socket to every replica's scheduler. It announces itself to each (each waits for all its
encoders before it is ready), but sends its ``EncoderStats`` to replica 0's alone: the frontend adds the replicas'
reports up (server/pool_stats.py ``merge``), so counters sent to every replica would count each image R times. It
exits once every scheduler has sent its Shutdown, so no replica loses its encoders while it still drains.

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
from typing import Any

import torch
import zmq

from ipc import endpoints
from ipc.channels import PullSocket, new_context
from ipc.control import ProcessReady, Shutdown
from ipc.encode import EncodeRelease, EncodeRequest
from ipc.inbound import EncoderInbound, SchedulerInbound
from ipc.stats import EncoderStats
from workers.common.proc import freeze_heap, setup_child
from workers.config import ServerConfig
from workers.encoder.cuda_landing import open_pool
from workers.encoder.nixl_landing import open_nixl_pool
from workers.encoder.recent import RecentEntries
from workers.encoder.tower import EncoderTower
from workers.engine.runner.batching import consecutive_runs, patches
from workers.engine.runner.model_runner import CUDA_HOST_THREADS

# Enough for the last answers to reach the scheduler before the process exits.
_LINGER_MS = 2_000
# Requests already queued are taken together, up to this many ViT calls' worth of patches: more would only hold back
# the answers of the first ones.
_BATCH_CALLS = 4
# A taken batch is encoded and answered in groups of at most this share of a ViT call's patches (one request at
# least): each group's entries land while the next group encodes, so a model worker waiting for a request's first
# image starts that request's first chunk instead of waiting for its last image. A quarter of the default call is
# 8,192 patches, one 1080p image of Qwen3-VL's tower (8,160), at which one call already fills an H200; four such
# images in one call made a 4 x 1080p request's first image land with its fourth, ~4 ViT times after it was asked for.
_ANSWER_SHARE = 4


class Schedulers:
    """The push sockets to the schedulers this encoder answers, by replica: one (its replica's), or every replica's
    when shared."""

    def __init__(self, ctx: zmq.Context[Any], launch_id: str, replicas: list[int]) -> None:
        self.socks = {r: endpoints.push(ctx, launch_id, endpoints.SCHEDULER, r) for r in replicas}
        self.stats_to = min(replicas)  # one receiver for the counters, so they are merged once

    def answer(self, replica: int, msg: SchedulerInbound) -> None:
        """To the scheduler of ``replica`` (a request's own field); an encoder of one replica answers its scheduler
        whatever the field says (requests built before the field existed say 0)."""
        self.socks[replica if len(self.socks) > 1 else self.stats_to].send(msg)

    def stats(self, msg: EncoderStats) -> None:
        self.socks[self.stats_to].send(msg)

    def everyone(self, msg: SchedulerInbound) -> None:
        for sock in self.socks.values():
            sock.send(msg)

    def close(self, linger_ms: int) -> None:
        for sock in self.socks.values():
            sock.close(linger_ms=linger_ms)


def run_encoder_worker(config: ServerConfig, index: int) -> None:
    """Entry point of encoder worker ``index`` (number ``index % encoder_workers`` of replica
    ``index // encoder_workers``, or shared by every replica): load the tower, announce readiness, encode until
    every scheduler it answers said Shutdown."""
    replicas = config.encoder_replicas(index)
    log = setup_child(f"glimpse.encoder[{index}]", config.log_level)
    ctx = new_context()
    # Bound before the (slow) load, so requests sent right after the ready ack find the endpoint.
    inbound = endpoints.pull(ctx, config.launch_id, endpoints.ENCODER, index)
    to_sched = Schedulers(ctx, config.launch_id, replicas)
    tower: EncoderTower | None = None
    try:
        started = time.monotonic()
        device = torch.device(config.encoder_device(index))
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # As in a CUDA model worker: the host side is staging copies, and a full OpenMP pool only spins.
            torch.set_num_threads(min(torch.get_num_threads(), CUDA_HOST_THREADS))
        tower = EncoderTower(config.engine, config.launch_id, index, device)
        # Every LM GPU that may import from the pool must reach it: all replicas' when the encoder is shared.
        if config.encoder_transport == "nixl":  # readers anywhere NIXL reaches: no peer-access check
            tower.pool = open_nixl_pool(index, device, config.encoder_landing_mb << 20, config.launch_id)
        else:
            tower.pool = open_pool(index, device, config.encoder_landing_mb << 20, config.encoder_readers(index))
        if len(replicas) > 1 and config.encoder_cache_mb:  # shared: one replica may ask for another's image
            tower.recent = RecentEntries(config.encoder_cache_mb << 20)
        log.info("vision tower of %s loaded in %.1fs on %s, %s", config.engine.model, time.monotonic() - started,
                 device, tower.dtype)
        freeze_heap(log)
        to_sched.everyone(ProcessReady(role="encoder", index=index, pid=os.getpid()))
        _serve(tower, inbound, to_sched, len(replicas), log)
    except Exception:
        log.exception("encoder worker failed")
        raise SystemExit(1) from None
    finally:
        inbound.close()
        to_sched.close(_LINGER_MS)
        ctx.term()
        if tower is not None and tower.pool is not None:
            tower.pool.close()
    if tower is not None:
        log.info("exiting: %d jobs, %d images encoded", tower.jobs, tower.counters.images_encoded)


def _serve(
    tower: EncoderTower, inbound: PullSocket[EncoderInbound], to_sched: Schedulers, senders: int,
    log: logging.Logger,
) -> None:
    """Encode requests as they come, each batch made of what is queued; answer, then report the counters. Returns
    after the ``senders``-th Shutdown (one per scheduler that sends here)."""
    budget = _BATCH_CALLS * tower.engine.vit_max_patches
    stops = 0
    while True:
        msg: EncoderInbound | None = inbound.recv()
        batch: list[EncodeRequest] = []
        stop: Shutdown | None = None
        total = released = 0
        while msg is not None:
            if isinstance(msg, Shutdown):
                stops += 1
                if stops >= senders:
                    stop = msg
                    break
                msg = inbound.recv(0)
                continue
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
        for group in answer_groups(batch, max(1, tower.engine.vit_max_patches // _ANSWER_SHARE)):
            for request, answer in zip(group, tower.run(group), strict=True):
                to_sched.answer(request.replica, answer)
        if batch or released:  # the counters, and the pool's use now
            to_sched.stats(_stats(tower))
        if stop is not None:
            log.info("shutdown requested%s", f": {stop.reason}" if stop.reason else "")
            return


def answer_groups(batch: list[EncodeRequest], max_patches: int) -> list[list[EncodeRequest]]:
    """``batch`` in order, in consecutive groups of at most ``max_patches`` patches (a request larger than that
    gets a group of its own). A request for a key an earlier request of the batch asked for joins that one's group,
    at no cost, so the tower still encodes a key once per batch (two replicas asking for one image)."""
    first: dict[bytes, EncodeRequest] = {}
    for request in batch:
        first.setdefault(request.key, request)
    distinct = list(first.values())
    runs = consecutive_runs(distinct, lambda r: sum(patches(item.grid) for item in r.items), max_patches)
    run_of = {request.key: i for i, run in enumerate(runs) for request in run}
    groups: list[list[EncodeRequest]] = [[] for _ in runs]
    for request in batch:
        groups[run_of[request.key]].append(request)
    return groups


def _stats(tower: EncoderTower) -> EncoderStats:
    c, pool = tower.counters, tower.pool
    return EncoderStats(
        tower.index, tower.jobs, c.images_encoded, c.vit_calls, tower.failed, tower.pixels.reads,
        tower.pixels.bytes_read, tower.landing_bytes,
        landing_pool_bytes=pool.size if pool is not None else 0,
        landing_pool_used_bytes=pool.used_bytes if pool is not None else 0,
        cuda_landings=tower.cuda_landings, shm_landings=tower.shm_landings, nixl_landings=tower.nixl_landings,
        reused=tower.reused,
        recent_bytes=tower.recent.bytes if tower.recent is not None else 0,
    )  # fmt: skip
