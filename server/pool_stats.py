"""Numbers of a server with several replicas (``--dp``), and the gauges an inference gateway scores by.

- ``merge``: the server's totals from each replica's ``SchedulerStats`` (what ``/admin/stats`` and the
  ``glimpse_*`` metrics show at the top level, as with one replica).
- ``replica_rows``: ``/admin/stats``' ``replicas`` list, one entry per replica with the router's view.
- ``PoolCollector``: per-replica ``glimpse_replica_*`` metrics, and the gauges the Gateway API Inference
  Extension's endpoint picker (llm-d's inference scheduler) reads from vLLM-compatible model servers, under
  vLLM's names: ``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``
  (0-1) and its older name ``vllm:gpu_cache_usage_perc`` (read by earlier pickers), ``vllm:lora_requests_info``
  (no adapters) and ``vllm:cache_config_info`` (block size and block count, for prefix-cache scorers). A
  picker scores a pod, so these are totals over the pod's replicas.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ipc.stats import SchedulerStats

if TYPE_CHECKING:
    from server.router import ReplicaView


class ReplicaReports(Protocol):
    """What these numbers read of the frontend's stats book (server/stats.py): each replica's latest report and
    their merge."""

    replicas: dict[int, SchedulerStats]
    scheduler: SchedulerStats | None

# Per-GPU figures, per-step sizes and the longest GC pause: the worst replica's value, not a sum.
_MAX_FIELDS = frozenset({"plan_bytes_last", "plan_bytes_max", "gpu_peak_bytes", "gpu_idle_bytes", "gc_pause_s_max"})


def merge(replicas: Iterable[SchedulerStats], tp_size: int = 1) -> SchedulerStats:
    """One report for the whole server: counts and sizes add up over replicas, per-GPU peaks take the
    largest, model workers are listed by their launch-wide index (replica * tp + rank)."""
    stats = sorted(replicas, key=lambda s: s.replica)
    if len(stats) == 1:
        return stats[0]
    fields: dict[str, Any] = {}
    for name in SchedulerStats.__struct_fields__:
        values = [getattr(s, name) for s in stats]
        if name == "workers":
            fields[name] = [
                msgspec.structs.replace(w, rank=s.replica * tp_size + w.rank) for s in stats for w in s.workers
            ]
        elif name == "encoders":  # already numbered launch-wide
            fields[name] = [e for s in stats for e in s.encoders]
        elif name == "replica":
            fields[name] = 0
        elif isinstance(values[0], int | float):
            fields[name] = max(values) if name in _MAX_FIELDS else sum(values)
        else:
            fields[name] = values[0]
    return SchedulerStats(**fields)


def replica_rows(book: ReplicaReports, views: Sequence[ReplicaView]) -> list[dict[str, Any]]:
    """``/admin/stats``' ``replicas``: each replica's own numbers and what the router sent it."""
    rows = []
    for r in range(max(len(views), len(book.replicas))):
        s = book.replicas.get(r)
        view = views[r] if r < len(views) else None
        row: dict[str, Any] = {
            "replica": r,
            "outstanding": view.outstanding if view else 0,
            "routed": view.routed if view else 0,
            "routed_by_affinity": view.by_affinity if view else 0,
        }
        if s is not None:
            row.update(
                requests={"running": s.requests_running, "waiting": s.requests_waiting},
                kv_blocks={"used": s.kv_blocks_used, "total": s.kv_blocks_total},
                window_blocks={"used": s.window_blocks_used, "total": s.window_blocks_total},
                generated_tokens=s.generated_tokens,
                prompt_tokens=s.prompt_tokens,
                prompt_tokens_computed=s.prompt_tokens_computed,
                prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
                images_encoded=s.images_encoded,
                mm_cache={"entries": s.mm_cache_entries, "hits": s.mm_cache_hits, "misses": s.mm_cache_misses},
                shm={"segments": s.shm_segments, "bytes": s.shm_bytes, "budget_bytes": s.shm_budget_bytes,
                     "landing_bytes": s.shm_landing_bytes},
            )
        rows.append(row)
    return rows


class PoolCollector(Collector):
    """Per-replica metrics and the vLLM-named gauges, read from the book at scrape time."""

    def __init__(
        self, book: ReplicaReports, views: Sequence[ReplicaView], tokenizer_outstanding: Sequence[int], model: str,
        block_size: int, kv_cache_dtype: str = "",
    ) -> None:
        self._book, self._views, self._tok = book, views, tokenizer_outstanding
        self._model, self._block_size, self._kv_dtype = model, block_size, kv_cache_dtype

    def collect(self) -> Iterable[Metric]:
        yield from self._vllm()
        yield from self._replicas()

    def _vllm(self) -> Iterable[Metric]:
        s, labels, model = self._book.scheduler, ["model_name"], [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(model, value)
            return family

        running = s.requests_running if s else 0
        # Waiting: the schedulers' queues plus requests still with a tokenizer (fetching or preparing their
        # images): both are queued work a picker should see, and image preparation can take a while.
        waiting = (s.requests_waiting if s else 0) + sum(self._tok)
        usage = s.kv_blocks_used / s.kv_blocks_total if s and s.kv_blocks_total else 0.0
        yield gauge("vllm:num_requests_running", "Requests running (vLLM's name, for inference gateways).", running)
        yield gauge("vllm:num_requests_waiting", "Requests queued (vLLM's name, for inference gateways).", waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1 (vLLM's name).", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 0-1 (vLLM's older name).", usage)
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info", "LoRA adapters (none: glimpse serves no adapters); value: update time.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        lora.add_metric(["0", "", ""], time.time())
        yield lora
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "KV cache configuration (vLLM's name).",
            labels=["block_size", "cache_dtype", "num_gpu_blocks"],
        )
        cache.add_metric([str(self._block_size), self._kv_dtype, str(s.kv_blocks_total if s else 0)], 1)
        yield cache

    def _replicas(self) -> Iterable[Metric]:
        prefix, labels = "glimpse_replica_", ["replica"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "requests_running": GaugeMetricFamily(prefix + "requests_running", "Requests running.", labels=labels),
            "requests_waiting": GaugeMetricFamily(prefix + "requests_waiting", "Requests waiting.", labels=labels),
            "kv_blocks_used": GaugeMetricFamily(prefix + "kv_blocks_used", "KV blocks in use.", labels=labels),
            "kv_blocks_total": GaugeMetricFamily(prefix + "kv_blocks_total", "KV blocks.", labels=labels),
            "images_encoded": CounterMetricFamily(prefix + "images_encoded", "Images encoded.", labels=labels),
            "prefix_cache_hit_tokens": CounterMetricFamily(
                prefix + "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", labels=labels
            ),
            "outstanding": GaugeMetricFamily(prefix + "outstanding", "Requests routed here, unfinished.", labels=labels),
            "routed": CounterMetricFamily(prefix + "routed", "Requests routed here.", labels=labels),
            "routed_by_affinity": CounterMetricFamily(
                prefix + "routed_by_affinity", "Requests routed here for the blocks and images it held.", labels=labels
            ),
        }
        for row in replica_rows(self._book, self._views):
            r = [str(row["replica"])]
            s = self._book.replicas.get(row["replica"])
            values = {"outstanding": row["outstanding"], "routed": row["routed"],
                      "routed_by_affinity": row["routed_by_affinity"]}
            if s is not None:
                values.update(
                    requests_running=s.requests_running, requests_waiting=s.requests_waiting,
                    kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total,
                    images_encoded=s.images_encoded, prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
                )
            for name, value in values.items():
                families[name].add_metric(r, value)
        yield from families.values()
