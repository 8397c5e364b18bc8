"""`/metrics`: the stats book (stats.py) as Prometheus metric families, made at scrape time by a custom collector
(the child processes' cumulative values cannot be "set" on Counter objects), plus the frontend's own latency
histograms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ipc.stats import EncoderStats, SchedulerStats
from server.stats import NO_TOKENIZER_STATS, StatsBook

_PREFIX = "glimpse"


class _BookCollector(Collector):
    """Turns the book into metric families at scrape time."""

    def __init__(self, book: StatsBook, outstanding: Sequence[int]) -> None:
        self._book = book
        self._outstanding = outstanding  # the live list owned by the frontend state

    def collect(self) -> Iterable[Metric]:
        book, c, s = self._book, self._book.counters, self._book.scheduler

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{_PREFIX}_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{_PREFIX}_{name}", doc, value=value)

        yield counter("requests", "Chat completion requests received.", c.total)
        yield counter("requests_ok", "Chat completion requests answered successfully.", c.ok)
        yield counter("requests_failed", "Chat completion requests answered with an error.", c.failed)
        yield counter("requests_aborted", "Chat completion requests whose client left first.", c.aborted)
        yield gauge("requests_in_flight", "Requests handed to a tokenizer and not finished.", c.in_flight)
        yield gauge("tokens_per_second", "Generated tokens per second (5 s window).", book.tokens_per_s())
        if s is not None:
            yield gauge("requests_running", "Requests the scheduler is running.", s.requests_running)
            yield gauge("requests_waiting", "Requests waiting for admission.", s.requests_waiting)
            yield counter("generated_tokens", "Tokens generated.", s.generated_tokens)
            yield counter("prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens)
            yield counter("scheduler_steps", "Scheduler steps run.", s.steps)
            yield gauge("kv_blocks_used", "KV cache blocks in use.", s.kv_blocks_used)
            yield gauge("kv_blocks_total", "KV cache blocks available.", s.kv_blocks_total)
            if s.window_blocks_total:
                yield gauge("window_blocks_used", "Sliding-window layers' KV blocks in use.", s.window_blocks_used)
                yield gauge("window_blocks_total", "Sliding-window layers' KV blocks.", s.window_blocks_total)
            if s.state_slots_total:
                yield gauge("state_slots_total", "Linear-attention state slots (hybrid models).", s.state_slots_total)
                yield gauge("state_slots_live", "State slots holding a running sequence.", s.state_slots_live)
                yield gauge("state_snapshots", "State snapshots held for the prefix cache.", s.state_snapshots)
                yield counter("state_restores", "Requests resumed from a state snapshot.", s.state_restores)
                yield counter("state_restored_tokens", "Prompt tokens skipped by state snapshots.", s.state_restored_tokens)
            yield gauge("mm_cache_entries", "Image embeddings cached.", s.mm_cache_entries)
            yield gauge("mm_cache_bytes", "Bytes of cached image embeddings.", s.mm_cache_bytes)
            yield counter("mm_cache_hits", "Image embedding cache hits.", s.mm_cache_hits)
            yield counter("mm_cache_misses", "Image embedding cache misses.", s.mm_cache_misses)
            yield counter("mm_cache_evictions", "Image embedding cache evictions.", s.mm_cache_evictions)
            if s.mm_host_cache_budget_bytes:
                yield gauge("mm_host_cache_budget_bytes", "Budget of the embedding cache's host tier.",
                            s.mm_host_cache_budget_bytes)
                yield gauge("mm_host_cache_bytes", "Bytes of image embeddings in the host tier.", s.mm_host_cache_bytes)
                yield gauge("mm_host_cache_entries", "Image embeddings in the host tier.", s.mm_host_cache_entries)
                yield counter("mm_host_cache_hits", "Embedding cache misses found in the host tier.",
                              s.mm_host_cache_hits)
                yield counter("mm_host_cache_spills", "Embeddings spilled from the GPU to the host tier.",
                              s.mm_host_cache_spills)
                yield counter("mm_host_cache_reloads", "Embeddings copied back from the host tier, not encoded.",
                              s.mm_host_cache_reloads)
                yield counter("mm_host_cache_evictions", "Host tier evictions.", s.mm_host_cache_evictions)
            if s.kv_host_cache_slots_total:
                yield gauge("kv_host_cache_slots_total", "KV blocks the prefix cache's host tier holds.",
                            s.kv_host_cache_slots_total)
                yield gauge("kv_host_cache_slots_used", "KV blocks held in the host tier now.", s.kv_host_cache_slots_used)
                yield counter("kv_host_cache_spilled_blocks", "KV blocks copied to the host tier before reuse.",
                              s.kv_host_cache_spilled_blocks)
                yield counter("kv_host_cache_loaded_blocks", "KV blocks loaded back from the host tier, not recomputed.",
                              s.kv_host_cache_loaded_blocks)
                yield counter("kv_host_cache_hit_tokens", "Prompt tokens served from the host tier.",
                              s.kv_host_cache_hit_tokens)
            yield counter("images_encoded", "Images run through the vision tower.", s.images_encoded)
            yield counter("vit_batches", "Vision tower batches run.", s.vit_batches)
            yield gauge("shm_segments", "Shared-memory pixel segments alive.", s.shm_segments)
            yield gauge("shm_bytes", "Bytes in shared memory the budget counts: pixels and landed embeddings.",
                        s.shm_bytes)
            yield gauge("shm_budget_bytes", "Budget of bytes in shared memory (--shm-budget-mb).", s.shm_budget_bytes)
            yield gauge("shm_landing_bytes", "Bytes of encoder workers' landed embeddings in shared memory.",
                        s.shm_landing_bytes)
            if s.encoders:
                yield from _encoder_metrics(s)
        def labelled(name: str, doc: str, kind: type[GaugeMetricFamily | CounterMetricFamily]) -> Any:
            return kind(f"{_PREFIX}_tokenizer_{name}", doc, labels=["worker"])

        outstanding = labelled("outstanding", "Requests sent to the tokenizer, not yet answered.", GaugeMetricFamily)
        queue_depth = labelled("queue_depth", "Requests queued inside the tokenizer.", GaugeMetricFamily)
        requests = labelled("requests", "Requests the tokenizer processed.", CounterMetricFamily)
        images = labelled("images", "Images the tokenizer handled.", CounterMetricFamily)
        reused = labelled("images_reused", "Images served from a live shm segment.", CounterMetricFamily)
        for i, n in enumerate(self._outstanding):
            t, worker = book.tokenizers.get(i, NO_TOKENIZER_STATS), [str(i)]
            outstanding.add_metric(worker, n)
            queue_depth.add_metric(worker, t.queue_depth)
            requests.add_metric(worker, t.requests)
            images.add_metric(worker, t.images)
            reused.add_metric(worker, t.images_reused)
        yield from (outstanding, queue_depth, requests, images, reused)


def _encoder_metrics(s: SchedulerStats) -> Iterable[Metric]:
    """--encoder-workers: each encoder's counters, labelled by its launch-wide index."""
    families = {
        "jobs": ("Image embeddings the encoder worker computed and handed over.", lambda e: e.jobs),
        "images_encoded": ("Images the encoder worker ran through its vision tower.", lambda e: e.images_encoded),
        "vit_calls": ("Vision tower calls of the encoder worker.", lambda e: e.vit_calls),
        "failed": ("Encode requests the encoder worker could not serve.", lambda e: e.failed),
        "cuda_landings": ("Embeddings the encoder worker landed in its CUDA landing pool.", lambda e: e.cuda_landings),
        "nixl_landings": ("Embeddings the encoder worker landed in its NIXL-registered pool.",
                          lambda e: e.nixl_landings),
        "shm_landings": ("Embeddings the encoder worker landed in shared memory.", lambda e: e.shm_landings),
        "reused": ("Encode requests a shared encoder answered with an entry computed for another request.",
                   lambda e: e.reused),
    }
    for name, (doc, value) in families.items():
        family = CounterMetricFamily(f"{_PREFIX}_encoder_{name}", doc, labels=["encoder"])
        for e in s.encoders:
            family.add_metric([str(e.index)], value(e))
        yield family
    gauges: dict[str, tuple[str, Callable[[EncoderStats], int]]] = {
        "landing_pool_bytes": ("Size of the encoder worker's CUDA landing pool (0: none).",
                               lambda e: e.landing_pool_bytes),
        "landing_pool_used_bytes": ("Bytes of the encoder worker's CUDA landing pool its entries hold.",
                                    lambda e: e.landing_pool_used_bytes),
        "recent_bytes": ("Host bytes a shared encoder's recent entries hold (--encoder-cache-mb).",
                         lambda e: e.recent_bytes),
    }
    for name, (doc, value) in gauges.items():
        gauge_family = GaugeMetricFamily(f"{_PREFIX}_encoder_{name}", doc, labels=["encoder"])
        for e in s.encoders:
            gauge_family.add_metric([str(e.index)], value(e))
        yield gauge_family


class Metrics:
    """A per-app Prometheus registry: two apps in one process (tests) never share metrics."""

    def __init__(self, book: StatsBook, outstanding: Sequence[int]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_BookCollector(book, outstanding))
        # Latencies are observed by the frontend itself, so plain histograms fit.
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
        self.ttft = Histogram(
            f"{_PREFIX}_time_to_first_token_seconds",
            "Time from request arrival to the first generated text.",
            buckets=buckets,
            registry=self.registry,
        )
        self.e2e = Histogram(
            f"{_PREFIX}_request_latency_seconds",
            "Time from request arrival to the last byte of a successful answer.",
            buckets=buckets,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
