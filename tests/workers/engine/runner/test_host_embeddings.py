"""The embedding cache's host tier, worker side: entries copied out of the GPU store into a host pool and back."""

from __future__ import annotations

import pytest
import torch

from workers.engine.core.mm_cache import PAGE_TOKENS, EmbeddingStore
from workers.engine.runner.host_embeddings import HostEmbeddings, _runs


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


def test_a_reload_for_one_step_keeps_the_host_entry_and_lands_transient() -> None:
    """StepPlan.mm_reload_once (a model worker without a tower, --encoder-workers): the GPU tier refused the entry,
    so it is read from the host tier for this step and stays there."""
    hidden = 3
    store = EmbeddingStore()
    host = HostEmbeddings(4 * PAGE_TOKENS * hidden * 4, hidden, torch.float32, torch.device("cpu"))
    a, b = torch.randn(20, hidden), torch.randn(5, hidden)
    store.put(b"a", a.clone(), transient=False)
    store.put(b"b", b.clone(), transient=False)
    host.spill([], [b"a", b"b"], store)
    host.land(host.reload([b"b"], once=[b"a"]), store)
    assert torch.equal(store.rows(b"a", 0, 20), a) and torch.equal(store.rows(b"b", 0, 5), b)
    assert b"a" in host and b"b" not in host and host.nbytes == 2 * host.page_bytes
    store.end_step()  # the step is over: the one-step copy goes, the reloaded entry stays
    assert b"a" not in store and b"b" in store
    host.land(host.reload([b"a"]), store)  # still whole in the host tier
    assert torch.equal(store.rows(b"a", 0, 20), a) and len(host) == 0


def test_entry_the_full_pool_cannot_take_is_kept_apart() -> None:
    hidden = 3
    store = EmbeddingStore()
    host = HostEmbeddings(PAGE_TOKENS * hidden * 4, hidden, torch.float32, torch.device("cpu"))  # 1 page + 1 slack
    a = torch.randn(40, hidden)
    store.put(b"a", a.clone(), transient=False)
    host.spill([], [b"a"], store)  # 3 pages: more than the pool has
    assert host.pool_misses == 1 and host.nbytes == 40 * hidden * 4
    host.land(host.reload([b"a"]), store)
    assert torch.equal(store.rows(b"a", 0, 40), a) and len(host) == 0


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
