"""Start-up heap freezing and the garbage-collection watch shared by the serving processes."""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterator

import pytest

from workers.common.proc import GcWatch, collector_paused, freeze_heap, startup_gc_summary, watch_startup_gc


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_a_frozen_object_is_out_of_the_collectors_reach(unfrozen: None) -> None:
    node = Node()
    ref = weakref.ref(node)
    frozen = freeze_heap(logging.getLogger("test"))
    # Frozen objects still die by reference count (the freeze's own temporaries right away); none join later.
    assert frozen >= gc.get_freeze_count() > 0
    del node
    gc.collect()
    assert ref() is not None  # frozen: a full collection does not walk it
    gc.unfreeze()
    gc.collect()
    assert ref() is None


def test_start_up_garbage_is_collected_before_the_freeze(unfrozen: None) -> None:
    node = Node()
    ref = weakref.ref(node)
    del node  # unreachable before the freeze: freed by it, not kept forever
    freeze_heap(logging.getLogger("test"))
    assert ref() is None


def test_the_watch_counts_collections_and_their_pauses() -> None:
    watch = GcWatch()
    try:
        gc.collect()
        gc.collect(0)
        assert watch.collections >= 2
        assert 0.0 < watch.pause_s_max <= watch.pause_s_sum
        full = watch.full
        assert full >= 1  # the gc.collect() above
        gc.collect(0)
        gc.collect(1)
        assert watch.full == full  # younger generations are not full collections
        gc.collect()
        assert watch.full == full + 1
    finally:
        watch.close()
    seen = watch.collections
    gc.collect()
    assert watch.collections == seen  # closed: no longer called


def test_the_start_up_watch_counts_collections_until_its_summary(unfrozen: None) -> None:
    assert startup_gc_summary() is None  # no watch started in this process
    watch_startup_gc()
    callbacks = len(gc.callbacks)
    gc.collect()  # one full collection
    gc.collect(0)
    summary = startup_gc_summary()
    assert summary is not None and summary.startswith("2 (1 full), ") and " s paused, longest " in summary
    assert len(gc.callbacks) == callbacks - 1  # the watch stopped: serving's collections are another watch's
    assert startup_gc_summary() is None


def test_imports_under_a_paused_collector_are_frozen_until_the_start_up_freeze(unfrozen: None) -> None:
    watch = GcWatch()
    with collector_paused():
        assert not gc.isenabled()
        garbage = Node()  # what an import leaves behind: a cycle only the collector frees
        ref = weakref.ref(garbage)
        kept = [Node() for _ in range(2000)]  # enough allocations to trigger collections were the collector on
        del garbage
    assert gc.isenabled() and watch.collections == 0
    assert gc.get_freeze_count() > len(kept)  # the imports' heap: out of reach of start-up's collections
    gc.collect()
    assert ref() is not None  # frozen: not walked
    freeze_heap(logging.getLogger("test"))
    assert ref() is None  # the start-up freeze unfroze it, collected the garbage once, and froze what lives
    watch.close()
