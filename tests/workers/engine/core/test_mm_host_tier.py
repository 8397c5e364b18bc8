"""The embedding cache's host tier, scheduler side: which entries spill and reload, GreedyDual-Size eviction."""

from __future__ import annotations

from ipc.prompts import MMItem
from workers.engine.core.mm_cache import EmbeddingCacheIndex
from workers.engine.core.mm_host_tier import ENCODE_FIXED_TOKENS, HostTierIndex


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


def test_a_host_entry_the_gpu_tier_refuses_is_copied_for_the_step_when_workers_cannot_encode() -> None:
    """``reload_refused`` (model workers without a tower, --encoder-workers): an entry the GPU tier cannot admit
    beside the step's hits is read from the host tier for this step only, not encoded, and stays there."""
    idx = EmbeddingCacheIndex(budget_bytes=100, bytes_per_token=10, host_budget_bytes=200)
    idx.plan(_needed((b"a", 6)))
    idx.plan(_needed((b"b", 6)))  # a -> host
    plain = idx.plan(_needed((b"b", 6), (b"a", 6)))  # b is pinned: a cannot come back beside it
    assert [(job.key, job.transient) for job in plain.encode] == [(b"a", True)] and plain.reload_once == []
    split = idx.plan(_needed((b"b", 6), (b"a", 6), (b"c", 3)), reload_refused=True)
    assert split.reload_once == [b"a"] and split.reload == [] and [job.key for job in split.encode] == [b"c"]
    assert b"a" in idx.host and b"a" not in idx and b"a" not in split.host_evict


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
