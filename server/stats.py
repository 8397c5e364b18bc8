"""Frontend bookkeeping for `/admin/stats` and `/metrics`: one source of numbers, two renderings (the JSON here,
Prometheus's in metrics.py).

The scheduler and tokenizers push cumulative snapshots (`SchedulerStats`, `TokenizerStats`); the
frontend keeps the latest of each plus its own HTTP counters. Prometheus reads the same book through
a custom collector at scrape time, so nothing is double-counted and no metric can drift from the
JSON view. Prometheus counters cannot be "set", which is why a collector (not Counter objects) exposes
the child processes' cumulative values.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from ipc.stats import SchedulerStats, TokenizerStats
from server.pool_stats import merge, replica_rows
from workers.common.proc import GcWatch

# Throughput is averaged over this window: one stats interval alone is too jumpy (a step that
# finished just before vs. just after a report doubles or zeroes the figure).
TOKENS_WINDOW_S = 5.0


@dataclass
class RequestCounters:
    """HTTP-side request accounting of the chat endpoint (the frontend's own numbers)."""

    total: int = 0  # chat requests received, rejected ones included
    ok: int = 0
    failed: int = 0  # answered with an error status (rejections, tokenizer/scheduler failures)
    aborted: int = 0  # the client went away first
    in_flight: int = 0  # handed to a tokenizer and not finished yet

    def record(self, outcome: str) -> None:
        """Count the end of an in-flight request: "ok", "failed" or "aborted"."""
        self.in_flight -= 1
        if outcome == "ok":
            self.ok += 1
        elif outcome == "failed":
            self.failed += 1
        else:
            self.aborted += 1


@dataclass
class StatsBook:
    """Latest snapshots from the children plus the frontend's counters."""

    counters: RequestCounters = field(default_factory=RequestCounters)
    scheduler: SchedulerStats | None = None
    tokenizers: dict[int, TokenizerStats] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    # --dp: each replica's latest report (``scheduler`` is their merge) and the router's view of them.
    replicas: dict[int, SchedulerStats] = field(default_factory=dict)
    routing: Sequence[Any] = ()  # server.router.ReplicaView per replica
    tp_size: int = 1
    kv_cache_dtype: str = ""  # the KV cache's element type (EngineConfig.kv_dtype_name), set by the frontend
    frontend_gc: GcWatch | None = None  # this process's collections while serving (set by the launcher)
    # (monotonic arrival time, cumulative generated tokens) of recent scheduler reports.
    _samples: deque[tuple[float, int]] = field(default_factory=deque)

    def on_scheduler(self, stats: SchedulerStats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.replicas[stats.replica] = stats
        self.scheduler = stats = merge(self.replicas.values(), self.tp_size)
        self._samples.append((now, stats.generated_tokens))
        # Keep one sample older than the window so the rate spans the whole window.
        while len(self._samples) > 2 and self._samples[1][0] <= now - TOKENS_WINDOW_S:
            self._samples.popleft()

    def on_tokenizer(self, stats: TokenizerStats) -> None:
        self.tokenizers[stats.worker] = stats

    def tokens_per_s(self, now: float | None = None) -> float:
        """Generated tokens per second over the last ~5 s of scheduler reports; 0 when idle or unknown."""
        now = time.monotonic() if now is None else now
        if len(self._samples) < 2:
            return 0.0
        t_last, n_last = self._samples[-1]
        if now - t_last > TOKENS_WINDOW_S:
            return 0.0  # no report lately: the scheduler is idle (or gone), not still producing
        t0, n0 = self._samples[0]
        dt = t_last - t0
        # max(): a restarted counter must not show a negative rate.
        return max(0, n_last - n0) / dt if dt > 0 else 0.0

    def snapshot(self, outstanding: Sequence[int], status: str) -> dict[str, Any]:
        """The `/admin/stats` JSON document; `outstanding` is per tokenizer, frontend-side."""
        # Before the scheduler's first report every figure reads zero.
        s = self.scheduler or NO_SCHEDULER_STATS
        c = self.counters
        lookups = s.mm_cache_hits + s.mm_cache_misses
        return {
            "status": status,
            "uptime_s": round(time.time() - self.started, 3),
            "requests": {
                "running": s.requests_running,
                "waiting": s.requests_waiting,
                "in_flight_http": c.in_flight,
                "total": c.total,
                "ok": c.ok,
                "failed": c.failed,
                "aborted": c.aborted,
            },
            "tokens_per_s": round(self.tokens_per_s(), 3),
            "generated_tokens": s.generated_tokens,
            "prompt_tokens": s.prompt_tokens,
            "steps": s.steps,
            "steps_ahead": s.steps_ahead,
            "samples_dropped": s.samples_dropped,
            "scheduler_gc": gc_row(s.gc_collections, s.gc_full, s.gc_pause_s_sum, s.gc_pause_s_max, s.gc_frozen, s.gc_idle_full),
            "frontend_gc": frontend_gc_row(self.frontend_gc),
            "kv_blocks": {"used": s.kv_blocks_used, "total": s.kv_blocks_total},
            "kv_cache_dtype": self.kv_cache_dtype,
            # Sliding-window models (Gemma 4): the sliding layers' own pool (kv_blocks is the global layers').
            "window_blocks": {
                "used": s.window_blocks_used, "total": s.window_blocks_total, "released": s.window_blocks_released,
            },
            "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
            "prompt_tokens_computed": s.prompt_tokens_computed,
            "state_pool": {  # hybrid models (Qwen3.5's linear attention): live states and prefix snapshots
                "slots": s.state_slots_total,
                "live": s.state_slots_live,
                "snapshots": s.state_snapshots,
                "snapshots_taken": s.state_snapshots_taken,
                "snapshots_evicted": s.state_snapshots_evicted,
                "restores": s.state_restores,
                "restored_tokens": s.state_restored_tokens,
            },
            "mm_cache": {
                "entries": s.mm_cache_entries,
                "bytes": s.mm_cache_bytes,
                "hits": s.mm_cache_hits,
                "misses": s.mm_cache_misses,
                "evictions": s.mm_cache_evictions,
                "hit_rate": (s.mm_cache_hits / lookups) if lookups else 0.0,
            },
            "mm_host_cache": {  # the host tier under mm_cache: what it evicts spills here, hits are copied back
                "budget_bytes": s.mm_host_cache_budget_bytes,
                "bytes": s.mm_host_cache_bytes,
                "entries": s.mm_host_cache_entries,
                "hits": s.mm_host_cache_hits,
                "spills": s.mm_host_cache_spills,
                "reloads": s.mm_host_cache_reloads,
                "evictions": s.mm_host_cache_evictions,
            },
            "kv_host_cache": {  # the host tier under the prefix cache: recycled GPU blocks spill here, hits load back
                "slots_total": s.kv_host_cache_slots_total,
                "slots_used": s.kv_host_cache_slots_used,
                "spilled_blocks": s.kv_host_cache_spilled_blocks,
                "loaded_blocks": s.kv_host_cache_loaded_blocks,
                "hit_tokens": s.kv_host_cache_hit_tokens,
            },
            "images_encoded": s.images_encoded,
            "vit_batches": s.vit_batches,
            "shm": {
                "segments": s.shm_segments,
                "bytes": s.shm_bytes,
                "budget_bytes": s.shm_budget_bytes,
                "retained_segments": s.shm_retained_segments,
                "retained_bytes": s.shm_retained_bytes,
                # --encoder-workers: landed embeddings not yet imported and unlinked (counted in "bytes" too)
                "landing_segments": s.shm_landing_segments,
                "landing_bytes": s.shm_landing_bytes,
            },
            "gpu": {
                "peak_allocated_bytes": s.gpu_peak_bytes or None,
                "idle_allocated_bytes": s.gpu_idle_bytes or None,
            },
            "plan_bytes": {"last": s.plan_bytes_last, "max": s.plan_bytes_max},
            "model_workers": [
                {
                    "rank": w.rank,
                    "pixel_reads": w.pixel_reads,
                    "pixel_bytes": w.pixel_bytes,
                    "images_encoded": w.images_encoded,
                    "vit_calls": w.vit_calls,
                    "vit_graph_replays": w.vit_graph_replays,
                    "images_ahead": w.images_ahead,
                    "ahead_waits": w.ahead_waits,
                    "nixl_reads": w.nixl_reads,  # --encoder-transport nixl: entries read, and their bytes
                    "nixl_bytes": w.nixl_bytes,
                    "steps": w.steps,
                    "weight_bytes": w.weight_bytes,
                    "vision_weight_bytes": w.vision_weight_bytes,  # 0 with --encoder-workers: no tower here
                    "broadcast_ms_mean": 1e3 * w.broadcast_s_sum / w.steps if w.steps else 0.0,
                    "broadcast_ms_max": 1e3 * w.broadcast_s_max,
                    "gc": gc_row(w.gc_collections, w.gc_full, w.gc_pause_s_sum, w.gc_pause_s_max, w.gc_frozen, w.gc_idle_full),
                }
                for w in s.workers
            ],
            # --encoder-workers: each encoder's counters (launch-wide index; empty without encoder workers).
            "encoder_workers": [
                {
                    "index": e.index,
                    "jobs": e.jobs,
                    "images_encoded": e.images_encoded,
                    "vit_calls": e.vit_calls,
                    "failed": e.failed,
                    "pixel_reads": e.pixel_reads,
                    "pixel_bytes": e.pixel_bytes,
                    "landing_bytes": e.landing_bytes,
                    # CUDA landing pool (GPU memory, not counted in "shm"): its size and the bytes its entries hold
                    "landing_pool_bytes": e.landing_pool_bytes,
                    "landing_pool_used_bytes": e.landing_pool_used_bytes,
                    "cuda_landings": e.cuda_landings,
                    "nixl_landings": e.nixl_landings,
                    "shm_landings": e.shm_landings,
                    # --shared-encoders: answers that reused another request's entry, and the recent entries' bytes
                    "reused": e.reused,
                    "recent_bytes": e.recent_bytes,
                }
                for e in s.encoders
            ],
            "tokenizers": [
                {
                    "worker": i,
                    "queue_depth": t.queue_depth,
                    "outstanding": n,
                    "requests": t.requests,
                    "images": t.images,
                    "images_reused": t.images_reused,
                    "images_deferred": t.images_deferred,
                    "videos": t.videos,
                    "videos_decoded": t.videos_decoded,
                    "video_frames_decoded": t.video_frames_decoded,
                    "video_groups_reused": t.video_groups_reused,
                }
                for i, n in enumerate(outstanding)
                for t in (self.tokenizers.get(i, NO_TOKENIZER_STATS),)
            ],
            "replicas": replica_rows(self, self.routing),
        }


def gc_row(
    collections: int, full: int, pause_s_sum: float, pause_s_max: float, frozen: int, idle_full: int
) -> dict[str, Any]:
    """One process's collections while serving (the pauses a step could wait on) and, apart, the full collections it
    ran while idle (workers/common/full_collections.py)."""
    return {
        "collections": collections,
        "full_collections": full,
        "pause_ms_sum": round(1e3 * pause_s_sum, 3),
        "pause_ms_max": round(1e3 * pause_s_max, 3),
        "frozen_objects": frozen,
        "idle_full_collections": idle_full,
    }


def frontend_gc_row(watch: GcWatch | None) -> dict[str, Any]:
    """The HTTP frontend's own collections (it writes every stream's chunks), zeros before it serves."""
    if watch is None:
        return gc_row(0, 0, 0.0, 0.0, 0, 0)
    return gc_row(watch.collections, watch.full, watch.pause_s_sum, watch.pause_s_max, watch.frozen, watch.idle_full)


NO_SCHEDULER_STATS = SchedulerStats(
    **cast(dict[str, Any], {f: 0 for f in SchedulerStats.__struct_fields__ if f not in ("workers", "encoders")})
)
NO_TOKENIZER_STATS = TokenizerStats(worker=-1, queue_depth=0, requests=0, images=0, images_reused=0)
