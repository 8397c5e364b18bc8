"""The landing pool's byte ranges (workers/encoder/landing_pool.py): aligned first fit, exact reuse, neighbours
merged on free in any order, fragmentation that leaves a request unplaced, and a full pool answered with None."""

from __future__ import annotations

import random

import pytest

from workers.encoder.landing_pool import ALIGN, RangeAllocator, align_up


def test_carve_aligns_offsets_and_rounds_lengths() -> None:
    pool = RangeAllocator(10 * ALIGN)
    offsets = [pool.carve(n) for n in (1, ALIGN, ALIGN + 1, 3)]
    assert offsets == [0, ALIGN, 2 * ALIGN, 4 * ALIGN]
    assert all(o is not None and o % ALIGN == 0 for o in offsets)
    assert pool.used_bytes == 5 * ALIGN
    assert pool.free_ranges == [(5 * ALIGN, 5 * ALIGN)]


def test_size_rounded_down_to_the_alignment() -> None:
    pool = RangeAllocator(3 * ALIGN + 17)
    assert pool.size == 3 * ALIGN
    assert pool.carve(3 * ALIGN) == 0
    assert pool.carve(1) is None
    assert RangeAllocator(ALIGN - 1).carve(1) is None


def test_full_pool_answers_none_then_fits_again_after_a_free() -> None:
    pool = RangeAllocator(4 * ALIGN)
    a, b = pool.carve(2 * ALIGN), pool.carve(2 * ALIGN)
    assert (a, b) == (0, 2 * ALIGN)
    assert pool.carve(1) is None
    pool.free(0)
    assert pool.carve(2 * ALIGN) == 0


def test_free_merges_with_both_neighbours() -> None:
    pool = RangeAllocator(8 * ALIGN)
    offsets = [pool.carve(2 * ALIGN) for _ in range(4)]
    assert offsets == [0, 2 * ALIGN, 4 * ALIGN, 6 * ALIGN]
    pool.free(0)
    pool.free(4 * ALIGN)
    assert pool.free_ranges == [(0, 2 * ALIGN), (4 * ALIGN, 2 * ALIGN)]
    pool.free(2 * ALIGN)  # joins the range before and the one after
    assert pool.free_ranges == [(0, 6 * ALIGN)]
    pool.free(6 * ALIGN)
    assert pool.free_ranges == [(0, 8 * ALIGN)] and pool.used_bytes == 0


def test_fragmentation_leaves_a_large_request_unplaced() -> None:
    pool = RangeAllocator(8 * ALIGN)
    offsets = [pool.carve(ALIGN) for _ in range(8)]
    for o in offsets[::2]:  # every other range back: 4 units free, none two long
        assert o is not None
        pool.free(o)
    assert pool.used_bytes == 4 * ALIGN
    assert pool.carve(2 * ALIGN) is None
    assert pool.carve(ALIGN) == 0  # first fit: the lowest hole


def test_double_free_and_bad_sizes_are_refused() -> None:
    pool = RangeAllocator(4 * ALIGN)
    o = pool.carve(10)
    assert o == 0
    pool.free(o)
    with pytest.raises(KeyError):
        pool.free(o)
    with pytest.raises(ValueError):
        pool.carve(0)
    with pytest.raises(ValueError):
        RangeAllocator(1024, align=3)


def test_random_carves_and_frees_keep_ranges_disjoint_and_coalesced() -> None:
    rng = random.Random(0)
    pool = RangeAllocator(1 << 20)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            del live[offset]
            pool.free(offset)
        else:
            n = rng.randint(1, 40_000)
            offset = pool.carve(n)
            if offset is not None:
                assert offset % ALIGN == 0
                live[offset] = align_up(n)
        spans = sorted([*live.items(), *pool.free_ranges])
        assert sum(length for _, length in spans) == pool.size  # used + free tile the pool exactly
        assert all(a + la == b for (a, la), (b, _) in zip(spans, spans[1:], strict=False))
        free = pool.free_ranges
        assert all(a + la < b for (a, la), (b, _) in zip(free, free[1:], strict=False))  # never two touching
        assert pool.used_bytes == sum(live.values())
