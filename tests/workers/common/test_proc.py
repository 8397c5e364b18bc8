"""Start-up heap freezing and the garbage-collection watch shared by the serving processes."""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterator

import pytest

from workers.common.proc import GcWatch, freeze_heap


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
