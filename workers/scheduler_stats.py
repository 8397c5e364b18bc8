"""The scheduler's periodic ``SchedulerStats``: what the frontend's /admin/stats and /metrics and the tokenizers'
routing read, built from the scheduler's core, ledger and counters."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgspec

from ipc.messages import SchedulerStats

if TYPE_CHECKING:
    from workers.scheduler import Scheduler

STATS_INTERVAL_S = 0.25
LOG_STATS_INTERVAL_S = 10.0


def send_stats(s: Scheduler, force: bool = False) -> None:
    """Every STATS_INTERVAL_S (or now, with ``force``): stats to the frontend and the tokenizers, retained images
    idle too long unlinked, and a log line every LOG_STATS_INTERVAL_S while there is work."""
    now = time.monotonic()
    if now < s.next_stats and not force:
        return
    s.next_stats = now + STATS_INTERVAL_S
    s.unlink(s.ledger.expire(now))  # retained images nobody resent for a while
    stats = snapshot(s)
    s.frontend.send(stats)
    for sock in s.tokenizers:
        sock.send(stats)
    core = s.core
    if now >= s.next_log and (core.running or core.waiting or s.log.isEnabledFor(logging.DEBUG)):
        s.next_log = now + LOG_STATS_INTERVAL_S
        s.log.info("%s plan_bytes=%s", msgspec.json.encode(stats).decode(), s.plan_bytes)


def snapshot(s: Scheduler) -> SchedulerStats:
    core, idx = s.core, s.core.mm_index
    return SchedulerStats(
        requests_running=len(core.running),
        requests_waiting=len(core.waiting),
        kv_blocks_used=core.allocator.num_used,
        kv_blocks_total=core.allocator.num_blocks,
        generated_tokens=s.generated_tokens,
        prompt_tokens=s.prompt_tokens,
        mm_cache_entries=len(idx),
        mm_cache_bytes=idx.used_bytes,
        mm_cache_hits=idx.stats.hits,
        mm_cache_misses=idx.stats.misses,
        mm_cache_evictions=idx.stats.evictions,
        images_encoded=s.images_encoded,
        vit_batches=s.vit_batches,
        shm_segments=s.ledger.segments,
        shm_bytes=s.ledger.used_bytes,
        shm_budget_bytes=s.ledger.budget_bytes,
        steps=s.steps,
        shm_retained_segments=s.ledger.retained_segments,
        shm_retained_bytes=s.ledger.retained_bytes,
        plan_bytes_last=s.plan_bytes["last"],
        plan_bytes_max=s.plan_bytes["max"],
        workers=[s.worker_stats[r] for r in sorted(s.worker_stats)],
        prefix_cache_hit_tokens=core.allocator.prefix_hit_tokens,
        prompt_tokens_computed=core.prompt_tokens_computed,
        gpu_peak_bytes=s.gpu_peak,
        gpu_idle_bytes=s.gpu_idle,
        replica=s.replica,
        steps_ahead=s.steps_ahead,
        samples_dropped=core.samples_dropped,
        gc_collections=s.gc.collections,
        gc_pause_s_max=s.gc.pause_s_max,
        gc_frozen=s.gc.frozen,
        gc_full=s.gc.full,
        gc_pause_s_sum=s.gc.pause_s_sum,
    )
