"""The scheduler's periodic ``SchedulerStats``: what the frontend's /admin/stats and /metrics and the tokenizers'
routing read, built from the scheduler's core, ledger and counters."""

from __future__ import annotations

from typing import Protocol

from ipc.stats import EncoderStats, SchedulerStats, WorkerStats
from workers.common.proc import GcWatch
from workers.engine.core.host_kv_index import kv_host_report
from workers.engine.core.scheduler import SchedulerCore
from workers.scheduler.shm_ledger import ShmLedger

STATS_INTERVAL_S = 0.25
LOG_STATS_INTERVAL_S = 10.0


class SchedulerState(Protocol):
    """The scheduler's parts and counters a snapshot reads (the scheduler process implements it)."""

    core: SchedulerCore
    ledger: ShmLedger
    gc: GcWatch
    worker_stats: dict[int, WorkerStats]
    encoder_stats: dict[int, EncoderStats]
    plan_bytes: dict[str, int]
    replica: int
    steps: int
    steps_ahead: int
    generated_tokens: int
    prompt_tokens: int
    images_encoded: int
    vit_batches: int
    gpu_peak: int
    gpu_idle: int


def snapshot(s: SchedulerState) -> SchedulerStats:
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
        **idx.host.report(),  # the embedding cache's host tier
        **kv_host_report(core.allocator.host),  # the prefix cache's host tier
        # Every image run through a vision tower, the model workers' and the encoder workers' alike.
        images_encoded=s.images_encoded + sum(e.images_encoded for e in s.encoder_stats.values()),
        vit_batches=s.vit_batches + sum(e.vit_calls for e in s.encoder_stats.values()),
        shm_segments=s.ledger.segments,
        shm_bytes=s.ledger.used_bytes,
        shm_budget_bytes=s.ledger.budget_bytes,
        steps=s.steps,
        shm_retained_segments=s.ledger.retained_segments,
        shm_retained_bytes=s.ledger.retained_bytes,
        shm_landing_segments=s.ledger.landing_segments,
        shm_landing_bytes=s.ledger.landing_bytes,
        plan_bytes_last=s.plan_bytes["last"],
        plan_bytes_max=s.plan_bytes["max"],
        workers=[s.worker_stats[r] for r in sorted(s.worker_stats)],
        encoders=[s.encoder_stats[i] for i in sorted(s.encoder_stats)],
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
        gc_idle_full=s.gc.idle_full,
        **(core.state.stats() if core.state is not None else {}),  # hybrid models' state pool
        **(core.windows.stats() if core.windows is not None else {}),  # sliding-window models' window pool
    )

