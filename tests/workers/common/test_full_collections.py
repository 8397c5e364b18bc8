"""FullCollections: the interpreter collects only its young generations on its own; the oldest one is collected when
the process has been idle, or when it has been busy too long, and the GcWatch tells those two apart."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from workers.common.full_collections import GC_IDLE_S, GC_OVERDUE_S, FullCollections
from workers.common.proc import GcWatch


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture
def watch() -> Iterator[GcWatch]:
    thresholds = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's own
    # What the suite built so far out of the collector's reach, as a server's start-up heap: CPython runs a full
    # collection only once the survivors since the last one reach a quarter of the oldest generation.
    gc.freeze()
    gc.collect()
    w = GcWatch()
    yield w
    w.close()
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def churn(n: int) -> list[dict[str, list[int]]]:
    """Cyclic garbage with long-lived survivors between it: what makes CPython collect its oldest generation."""
    kept = []
    for i in range(n):
        Node()
        if i % 10 == 0:
            kept.append({"x": [i]})
    return kept


def test_the_oldest_generation_waits_for_an_idle_moment(watch: GcWatch) -> None:
    full = FullCollections(watch, enabled=True)
    assert gc.get_threshold()[2] > 1 << 20
    kept = churn(1_000_000)  # the interpreter alone runs full collections under this churn (next test)
    assert watch.full == 0 and watch.collections > 0  # the young generations are still collected
    garbage = Node()
    ref = weakref.ref(garbage)
    del garbage
    full.worked(100.0, idle=False)
    full.worked(101.0, idle=True)  # the last step in flight ended
    assert not full.poll(101.0 + GC_IDLE_S / 2, idle=True)  # not idle long enough
    assert not full.poll(101.0 + GC_IDLE_S, idle=False)  # work came meanwhile
    assert ref() is not None
    assert full.poll(101.0 + GC_IDLE_S, idle=True)
    assert ref() is None
    assert (watch.idle_full, watch.full, full.idle_runs) == (1, 0, 1)
    assert not full.poll(200.0, idle=True)  # nothing since
    assert len(kept) == 100_000


def test_the_interpreter_alone_collects_the_oldest_generation_under_the_same_churn(watch: GcWatch) -> None:
    FullCollections(watch, enabled=False)
    churn(1_000_000)
    assert watch.full > 0 and watch.idle_full == 0


def test_a_busy_process_collects_once_overdue_and_it_counts_as_a_pause(watch: GcWatch) -> None:
    full = FullCollections(watch, enabled=True)
    full.worked(1_000.0, idle=False)
    full.worked(1_030.0, idle=False)
    assert not full.poll(1_000.0 + GC_OVERDUE_S - 1, idle=False)
    assert full.poll(1_000.0 + GC_OVERDUE_S, idle=False)
    assert (watch.full, watch.idle_full, full.overdue_runs) == (1, 0, 1)
    # Work after a long quiet time is not overdue at once: the clock starts with it.
    full.worked(5_000.0, idle=False)
    assert not full.poll(5_000.5, idle=False)


def test_switched_off_the_interpreter_keeps_its_schedule(watch: GcWatch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIMPSE_GC_OFF_PATH", "0")
    before = gc.get_threshold()
    full = FullCollections(watch)
    assert not full.enabled and gc.get_threshold() == before
    full.worked(1.0, idle=True)
    assert not full.pending and not full.poll(100.0, idle=True)


def test_close_gives_the_interpreter_its_schedule_back(watch: GcWatch) -> None:
    before = gc.get_threshold()
    full = FullCollections(watch, enabled=True)
    assert gc.get_threshold() != before
    full.worked(1.0, idle=True)
    full.close()
    assert gc.get_threshold() == before and not full.poll(100.0, idle=True)
