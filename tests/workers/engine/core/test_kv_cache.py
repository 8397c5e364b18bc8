from __future__ import annotations

import pytest

from workers.engine.core.kv_cache import BlockAllocator, OutOfBlocks, block_hashes, slot_mapping


def test_allocate_and_free_round_trip() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert len(set(a) | set(b)) == 8
    assert alloc.num_free == 0 and alloc.num_used == 8
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)
    alloc.free(a)
    assert alloc.num_free == 3
    assert sorted(alloc.allocate(3)) == sorted(a)


def test_double_free_is_an_error() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    blocks = alloc.allocate(2)
    alloc.free(blocks)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(blocks[:1])


def test_blocks_for_rounds_up() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=16)
    assert [alloc.blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_slot_mapping_follows_block_table() -> None:
    # Token p lives in block_table[p // bs] at offset p % bs, whatever order the blocks come in.
    table = [7, 2, 5]
    assert slot_mapping(table, 0, 3, 4) == [28, 29, 30]
    assert slot_mapping(table, 3, 4, 4) == [31, 8, 9, 10]
    assert slot_mapping(table, 9, 2, 4) == [21, 22]
    # every start and length against the per-token rule: block table[p // size], offset p % size
    for start in range(12):
        for length in range(12 - start + 1):
            want = [table[p // 4] * 4 + p % 4 for p in range(start, start + length)]
            assert slot_mapping(table, start, length, 4) == want, (start, length)


def test_a_freed_table_is_recycled_tail_first_so_its_prefix_survives() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    hashes = block_hashes(list(range(8)), 2)
    table = alloc.allocate(4)
    for block, digest in zip(table, hashes, strict=True):
        alloc.register(block, digest)
    alloc.free(table)
    alloc.allocate(2)  # another request takes half the pool
    assert alloc.match(hashes) == table[:2]  # a returning prompt still finds its first half
