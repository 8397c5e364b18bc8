from __future__ import annotations

import torch

from workers.engine.mm_cache import EmbeddingCacheIndex, EmbeddingStore


def test_lru_eviction_order_and_bytes() -> None:
    idx = EmbeddingCacheIndex(budget_bytes=100, bytes_per_token=10)
    assert idx.admit(b"a", 4, set()) == (True, [])
    assert idx.admit(b"b", 4, set()) == (True, [])
    assert idx.lookup(b"a", 4) == (True, None)  # a is now most recent
    admitted, evicted = idx.admit(b"c", 4, set())
    assert admitted and evicted == [b"b"]
    assert idx.used_bytes == 80 and len(idx) == 2
    assert idx.stats.evictions == 1 and idx.stats.hits == 1


def test_entry_larger_than_budget_is_refused() -> None:
    idx = EmbeddingCacheIndex(budget_bytes=100, bytes_per_token=10)
    idx.admit(b"a", 5, set())
    assert idx.admit(b"huge", 11, set()) == (False, [])
    assert b"a" in idx and idx.stats.refused == 1  # nothing was evicted for a hopeless entry


def test_pinned_entries_are_never_evicted() -> None:
    idx = EmbeddingCacheIndex(budget_bytes=100, bytes_per_token=10)
    idx.admit(b"a", 6, set())
    assert idx.admit(b"b", 6, pinned={b"a"}) == (False, [])
    assert b"a" in idx
    assert idx.admit(b"b", 6, pinned=set()) == (True, [b"a"])


def test_token_count_mismatch_is_a_miss_and_drops_the_entry() -> None:
    idx = EmbeddingCacheIndex(budget_bytes=100, bytes_per_token=10)
    idx.admit(b"a", 4, set())
    assert idx.lookup(b"a", 5) == (False, b"a")
    assert b"a" not in idx and idx.used_bytes == 0
    assert idx.stats.token_mismatches == 1 and idx.stats.misses == 1


def test_store_obeys_evictions_and_drops_transient_entries() -> None:
    store = EmbeddingStore()
    store.put(b"keep", torch.zeros(2, 3), transient=False)
    store.put(b"once", torch.zeros(4, 3), transient=True)
    assert len(store) == 2 and store.nbytes == 6 * 3 * 4
    store.end_step()
    assert b"once" not in store and b"keep" in store
    store.evict([b"keep", b"missing"])
    assert len(store) == 0
