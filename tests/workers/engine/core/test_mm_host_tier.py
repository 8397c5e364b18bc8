"""The embedding cache's host tier: the scheduler's index (spills, reloads, GreedyDual-Size eviction) and the worker's
store of host entries (copies out of and back into the GPU store), on the CPU."""

from __future__ import annotations

import pytest
import torch

from ipc.prompts import MMItem
from workers.engine.core.mm_cache import PAGE_TOKENS, EmbeddingCacheIndex, EmbeddingStore
from workers.engine.core.mm_host_tier import ENCODE_FIXED_TOKENS, HostTierIndex
from workers.engine.runner.host_embeddings import HostEmbeddings, _runs


def _needed(*entries: tuple[bytes, int]) -> dict[bytes, list[MMItem]]:
    return {key: [MMItem(key, 0, tokens, (1, 2, tokens * 2))] for key, tokens in entries}


def test_gpu_overflow_spills_and_a_host_hit_is_reloaded_not_encoded() -> None:
    idx = EmbeddingCacheIndex(budget_bytes=100, bytes_per_token=10, host_budget_bytes=200)
    first = idx.plan(_needed((b"a", 6)))
    assert [job.key for job in first.encode] == [b"a"] and first.spill == [] == first.evict
    second = idx.plan(_needed((b"b", 6)))  # b does not fit beside a: a leaves the GPU tier for the host
    assert second.spill == [b"a"] and second.evict == [] and [job.key for job in second.encode] == [b"b"]
    assert b"a" in idx.host and b"a" not in idx and idx.host.used_bytes == 60
    third = idx.plan(_needed((b"a", 6)))  # a again: copied back, b spills to make room, nothing encoded
    assert third.reload == [b"a"] and third.encode == [] and third.spill == [b"b"]
    assert b"a" in idx and b"a" not in idx.host and b"b" in idx.host  # the tiers are exclusive
    assert idx.host.stats.hits == 1 and idx.host.stats.reloads == 1 and idx.host.stats.spills == 2
    assert idx.stats.misses == 3  # a GPU miss each time: the host hit is counted apart


def test_host_eviction_follows_cost_per_byte_not_recency() -> None:
    host = HostTierIndex(budget_bytes=100, bytes_per_token=1)
    assert host.spill(b"small", 10, set()) == (True, [])  # oldest, but dearest to re-encode per byte
    assert host.spill(b"big", 60, set()) == (True, [])
    assert host.priority(b"small") == (10 + ENCODE_FIXED_TOKENS) / 10 > host.priority(b"big")
    # 40 more bytes: LRU would drop small first (and then big too); GreedyDual-Size drops big alone.
    assert host.spill(b"medium", 40, set()) == (True, [b"big"])
    assert host.clock == (60 + ENCODE_FIXED_TOKENS) / 60  # aging: newer entries start above big's priority
    assert host.priority(b"medium") == host.clock + (40 + ENCODE_FIXED_TOKENS) / 40
    assert host.used_bytes == 50 and host.stats.evictions == 1


def test_entry_larger_than_the_host_budget_is_dropped() -> None:
    idx = EmbeddingCacheIndex(budget_bytes=100, bytes_per_token=10, host_budget_bytes=50)
    idx.plan(_needed((b"big", 8)))
    plan = idx.plan(_needed((b"next", 8)))  # big (80 bytes) leaves the GPU: too large for a host tier of 50
    assert plan.evict == [b"big"] and plan.spill == []
    assert b"big" not in idx.host and idx.host.stats.refused == 1


def test_spills_never_evict_what_the_step_reloads() -> None:
    idx = EmbeddingCacheIndex(budget_bytes=100, bytes_per_token=10, host_budget_bytes=60)
    idx.plan(_needed((b"a", 6)))
    idx.plan(_needed((b"b", 6)))  # a -> host (full)
    plan = idx.plan(_needed((b"a", 6)))  # reload a; b spills only once a's host rows are no longer needed...
    # ...which is after this step's reloads: within the step the host tier still holds a, so b is dropped.
    assert plan.reload == [b"a"] and plan.evict == [b"b"] and plan.spill == [] and plan.host_evict == []


def test_host_entry_of_another_size_is_dropped_and_encoded() -> None:
    idx = EmbeddingCacheIndex(budget_bytes=100, bytes_per_token=10, host_budget_bytes=200)
    idx.plan(_needed((b"a", 6)))
    idx.plan(_needed((b"b", 6)))
    plan = idx.plan(_needed((b"a", 5)))
    assert plan.host_evict == [b"a"] and plan.reload == [] and [job.key for job in plan.encode] == [b"a"]
    assert idx.host.stats.token_mismatches == 1


def test_a_failed_step_drops_its_keys_from_both_tiers_next_time() -> None:
    idx = EmbeddingCacheIndex(budget_bytes=100, bytes_per_token=10, host_budget_bytes=200)
    idx.plan(_needed((b"a", 6)))
    plan = idx.plan(_needed((b"b", 6)))
    idx.fail_step([job.key for job in plan.encode], plan.spill, plan.reload)
    assert b"a" not in idx.host and b"b" not in idx and idx.used_bytes == 0 == idx.host.used_bytes
    after = idx.plan({})
    assert sorted(after.evict) == sorted(after.host_evict) == [b"a", b"b"]


def test_runs_merge_consecutive_pages() -> None:
    assert _runs([3, 4, 5, 9], 3 * PAGE_TOKENS + 2) == [
        (3 * PAGE_TOKENS, 0, 3 * PAGE_TOKENS), (9 * PAGE_TOKENS, 3 * PAGE_TOKENS, 2),
    ]  # fmt: skip
    assert _runs([7], 5) == [(7 * PAGE_TOKENS, 0, 5)]


def test_worker_spill_and_reload_round_trip_the_rows() -> None:
    hidden = 3
    store = EmbeddingStore()
    host = HostEmbeddings(4 * PAGE_TOKENS * hidden * 4, hidden, torch.float32, torch.device("cpu"))
    a = torch.arange(40 * hidden, dtype=torch.float32).view(40, hidden)  # three pages, the last part-filled
    b = -torch.arange(20 * hidden, dtype=torch.float32).view(20, hidden)
    store.put(b"a", a.clone(), transient=False)
    store.put(b"b", b.clone(), transient=False)
    host.spill([], [b"a", b"b"], store)
    assert b"a" not in store and b"b" not in store and len(host) == 2 and host.spilled == 2
    assert host.nbytes == 5 * host.page_bytes
    host.land(host.reload([b"a"]), store)
    assert torch.equal(store.rows(b"a", 0, 40), a) and b"a" not in host and host.reloaded == 1
    host.spill([b"b"], [], store)  # a host eviction frees b's pages
    assert len(host) == 0 and host.nbytes == 0
    host.spill([], [b"a"], store)  # a again, into the pages freed first
    host.land(host.reload([b"a"]), store)
    assert torch.equal(store.rows(b"a", 13, 20), a[13:33]) and host.pool_misses == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_are_ordered_against_page_reuse() -> None:
    """CUDA: the pinned pool, spills on the compute stream and reloads on the side stream. Entries are large (32 MiB)
    so that a copy still runs while the next operation is queued: a spilled entry's GPU pages are taken by a new entry
    at once, and a reload's host pages by a new spill before the reload has landed."""
    rows, hidden, device = 8192 * PAGE_TOKENS // 16, 1024, torch.device("cuda")
    entry_bytes = rows * hidden * 4
    store = EmbeddingStore(2 * entry_bytes, hidden, torch.float32, device)
    host = HostEmbeddings(2 * entry_bytes, hidden, torch.float32, device)
    assert host.pool is not None and not host.pool.is_cuda
    data = {k: torch.randn(rows, hidden, device=device) for k in (b"a", b"b", b"c")}
    store.put(b"a", data[b"a"], transient=False)
    host.spill([], [b"a"], store)
    store.put(b"b", data[b"b"], transient=False)  # into a's GPU pages, right behind a's device-to-host copy
    store.put(b"c", data[b"c"], transient=False)
    reloading = host.reload([b"a"])  # waits for a's spill on the side stream
    host.spill([], [b"c"], store)  # into a's host pages: waits for that reload first
    host.land(reloading, store)
    assert torch.equal(store.rows(b"a", 0, rows), data[b"a"]) and torch.equal(store.rows(b"b", 0, rows), data[b"b"])
    host.land(host.reload([b"c"]), store)
    torch.cuda.synchronize()
    assert torch.equal(store.rows(b"c", 0, rows), data[b"c"]) and host.pool_misses == 0 and len(host) == 0
