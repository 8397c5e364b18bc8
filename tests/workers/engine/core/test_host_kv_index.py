from __future__ import annotations

import pytest

from workers.engine.core.host_kv_index import REPORT_FIELDS, HostKVIndex, kv_host_report
from workers.engine.core.kv_cache import BlockAllocator, block_hashes


def _cached_prompt(alloc: BlockAllocator, tokens: list[int]) -> tuple[list[bytes], list[int]]:
    """Allocate, register and free a prompt's full blocks, as a finished request leaves them."""
    hashes = block_hashes(tokens, alloc.block_size)
    blocks = alloc.allocate(len(hashes))
    for block, digest in zip(blocks, hashes, strict=True):
        alloc.register(block, digest)
    alloc.free(blocks)
    return hashes, blocks


def _with_host(num_blocks: int, num_slots: int) -> tuple[BlockAllocator, HostKVIndex]:
    alloc = BlockAllocator(num_blocks=num_blocks, block_size=4)
    alloc.host = HostKVIndex(num_slots=num_slots, block_size=4)
    return alloc, alloc.host


def test_reusing_a_registered_block_spills_it_first() -> None:
    alloc, host = _with_host(num_blocks=2, num_slots=4)
    hashes, blocks = _cached_prompt(alloc, list(range(8)))
    alloc.allocate(2)  # an unrelated request takes both cached blocks
    spill, load = host.take_copies()
    assert spill == [(blocks[1], 0), (blocks[0], 1)] and load == []  # a freed prompt is recycled tail first
    assert host.spills == 2 and host.num_used == 2
    assert alloc.match(hashes) == [] and host.match(hashes) == [1, 0]
    assert host.take_copies() == ([], [])  # the lists belong to one step


def test_unregistered_blocks_are_not_spilled() -> None:
    alloc, host = _with_host(num_blocks=2, num_slots=4)
    alloc.free(alloc.allocate(2))
    alloc.allocate(2)
    assert host.take_copies() == ([], []) and host.spills == 0


def test_host_hit_loads_into_fresh_blocks_and_counts_tokens() -> None:
    alloc, host = _with_host(num_blocks=4, num_slots=4)
    hashes, _ = _cached_prompt(alloc, list(range(8)))
    other = alloc.allocate(4)  # evicts the prompt from the device
    alloc.free(other[:2])
    host.take_copies()
    assert alloc.match(hashes) == []
    blocks = alloc.load_from_host(hashes)
    spill, load = host.take_copies()
    # The prompt's tail spilled first (slot 0), its head second; the reused blocks carried no key.
    assert load == [(1, blocks[0]), (0, blocks[1])] and spill == []
    assert alloc.match(hashes) == blocks  # registered on the device again
    assert host.loads == 2 and host.hit_tokens == 8
    assert alloc.prefix_hit_tokens == 0  # a host hit is not counted as a device hit too


def test_block_on_device_and_host_is_stored_once() -> None:
    alloc, host = _with_host(num_blocks=2, num_slots=4)
    hashes, _ = _cached_prompt(alloc, list(range(8)))
    alloc.free(alloc.allocate(2))
    host.take_copies()
    blocks = alloc.load_from_host(hashes)
    host.take_copies()
    alloc.free(blocks)
    alloc.allocate(2)  # the loaded blocks are recycled: the host already holds their keys
    assert host.take_copies() == ([], []) and host.spills == 2 and host.num_used == 2


def test_host_evicts_its_oldest_entry() -> None:
    alloc, host = _with_host(num_blocks=1, num_slots=2)
    first, _ = _cached_prompt(alloc, [1, 2, 3, 4])
    second, _ = _cached_prompt(alloc, [5, 6, 7, 8])  # spills first
    third, _ = _cached_prompt(alloc, [9, 10, 11, 12])  # spills second
    alloc.allocate(1)  # spills third over the oldest (first)
    spill, _ = host.take_copies()
    assert [slot for _, slot in spill] == [0, 1, 0]
    assert host.match(first) == [] and host.match(second) == [1] and host.match(third) == [0]


def test_a_slot_read_this_step_is_not_overwritten_by_a_spill() -> None:
    alloc, host = _with_host(num_blocks=1, num_slots=1)
    first, _ = _cached_prompt(alloc, [1, 2, 3, 4])
    second, _ = _cached_prompt(alloc, [5, 6, 7, 8])  # first goes to slot 0, second stays on the device
    host.take_copies()
    # Loading first recycles the device block holding second: no free slot but the pinned one, so no spill.
    blocks = alloc.load_from_host(first)
    spill, load = host.take_copies()
    assert load == [(0, blocks[0])] and spill == []
    assert alloc.match(second) == [] and host.match(second) == []


def test_index_rejects_empty_pool() -> None:
    with pytest.raises(ValueError):
        HostKVIndex(num_slots=0, block_size=4)


def test_forget_drops_a_failed_spill_unless_its_slot_moved_on() -> None:
    alloc, host = _with_host(num_blocks=1, num_slots=1)
    first, _ = _cached_prompt(alloc, [1, 2, 3, 4])
    _cached_prompt(alloc, [5, 6, 7, 8])  # first spills to slot 0
    failed = host.drain()
    assert failed.spilled == [(first[0], 0)] and failed.spill == [(0, 0)]
    host.forget(failed.spilled)
    assert host.match(first) == [] and host.num_used == 0
    _cached_prompt(alloc, [9, 10, 11, 12])  # the slot is free again: the second key takes it
    assert host.num_used == 1
    moved = host.drain()
    host.forget(failed.spilled)  # (again, late) the slot holds another key now: kept
    assert host.num_used == 1 and moved.spilled[0][1] == 0


def test_report_names_the_stats_fields() -> None:
    assert kv_host_report(None) == dict.fromkeys(REPORT_FIELDS, 0)
    alloc, host = _with_host(num_blocks=1, num_slots=3)
    _cached_prompt(alloc, [1, 2, 3, 4])
    _cached_prompt(alloc, [5, 6, 7, 8])
    assert kv_host_report(host) == {
        "kv_host_cache_slots_total": 3, "kv_host_cache_slots_used": 1, "kv_host_cache_spilled_blocks": 1,
        "kv_host_cache_loaded_blocks": 0, "kv_host_cache_hit_tokens": 0,
    }  # fmt: skip
