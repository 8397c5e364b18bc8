from __future__ import annotations

import torch

from workers.engine.core.mm_cache import PAGE_TOKENS, POOL_SLACK_PAGES, EmbeddingCacheIndex, EmbeddingStore


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


def test_a_kept_entry_holds_its_own_rows_not_the_call_output_it_was_cut_from() -> None:
    store = EmbeddingStore()
    output = torch.arange(30.0).view(10, 3)  # one ViT call's rows: three images
    first, rest, last = output.split([2, 5, 3])
    store.put(b"a", first, transient=False)
    store.put(b"b", rest, transient=True)  # dropped at the step's end: no copy needed
    store.put(b"c", last, transient=False)
    for key, rows in ((b"a", first), (b"c", last)):
        kept = store.rows(key, 0, rows.shape[0])
        assert torch.equal(kept, rows) and kept.untyped_storage().nbytes() == rows.nbytes
    assert store.rows(b"b", 0, 5).data_ptr() == rest.data_ptr()
    whole = torch.ones(4, 3)
    store.put(b"d", whole, transient=False)  # a tensor of its own is kept as it is
    assert store.rows(b"d", 0, 4).data_ptr() == whole.data_ptr()


def _pooled(pages: int, hidden: int = 3) -> EmbeddingStore:
    """A store whose pool has exactly ``pages`` pages (the slack pages are part of the count)."""
    page_bytes = PAGE_TOKENS * hidden * 4
    budget = max(0, pages - POOL_SLACK_PAGES) * page_bytes
    store = EmbeddingStore(budget or 1, hidden, torch.float32, "cpu")
    del store._free[: len(store._free) - pages]  # keep the lowest ``pages`` pages
    return store


def test_pooled_store_returns_the_rows_it_was_given_across_pages() -> None:
    store = _pooled(8)
    a = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)  # 3 pages, the last one part-filled
    b = -torch.arange(16 * 3, dtype=torch.float32).view(16, 3)  # exactly 1 page
    store.put(b"a", a, transient=False)
    store.put(b"b", b, transient=False)
    assert torch.equal(store.rows(b"a", 0, 40), a) and torch.equal(store.rows(b"b", 0, 16), b)
    assert torch.equal(store.rows(b"a", 13, 20), a[13:33])  # a chunk's slice, straddling page borders
    assert store.nbytes == 4 * store.page_bytes and store.pool is not None
    pool_before = store.pool.data_ptr()
    store.evict([b"a"])
    store.put(b"c", torch.ones(48, 3), transient=False)  # reuses a's three pages
    assert torch.equal(store.rows(b"b", 0, 16), b) and torch.equal(store.rows(b"c", 0, 48), torch.ones(48, 3))
    assert store.pool.data_ptr() == pool_before and store.pool_misses == 0


def test_pooled_store_keeps_transient_and_overflow_entries_out_of_the_pool() -> None:
    store = _pooled(2)
    store.put(b"once", torch.ones(40, 3), transient=True)  # transient: never takes pages
    store.put(b"fits", torch.full((20, 3), 2.0), transient=False)  # 2 pages: the whole pool
    store.put(b"over", torch.full((5, 3), 3.0), transient=False)  # pool full -> its own tensor
    assert store.pool_misses == 1 and len(store) == 3
    assert torch.equal(store.rows(b"over", 1, 3), torch.full((3, 3), 3.0))
    assert torch.equal(store.rows(b"once", 0, 40), torch.ones(40, 3))
    store.end_step()
    assert b"once" not in store
    store.put(b"fits", torch.full((4, 3), 5.0), transient=False)  # a re-put replaces and frees the old pages
    assert store.nbytes == store.page_bytes + 5 * 3 * 4
    assert torch.equal(store.rows(b"fits", 0, 4), torch.full((4, 3), 5.0))
    store.evict([b"fits", b"over"])
    assert len(store) == 0 and store.nbytes == 0
