from __future__ import annotations

import torch

from workers.engine.runner.host_kv import HostKVPool


def test_spill_then_load_round_trips_blocks() -> None:
    # Layout as the runner allocates it: (k/v, blocks, block_size, heads, head_dim) per layer.
    caches = [torch.randn(2, 5, 4, 2, 3) for _ in range(2)]
    before = [c.clone() for c in caches]
    pool = HostKVPool(caches, num_slots=3)
    assert HostKVPool.bytes_per_slot(caches) == 2 * (2 * 4 * 2 * 3 * 4)
    pool.apply(spill=[(1, 2), (3, 0)], load=[])
    for c in caches:
        c[:, [1, 3]] = 0.0  # the blocks are handed out and overwritten
    pool.apply(spill=[], load=[(2, 4), (0, 0)])
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[:, 4], b[:, 1]) and torch.equal(c[:, 0], b[:, 3])
        assert torch.equal(c[:, 2], b[:, 2])  # untouched blocks stay


def test_spill_and_load_in_one_step_reads_before_overwrite() -> None:
    caches = [torch.randn(2, 3, 4, 1, 2)]
    old = caches[0][:, 0].clone()
    pool = HostKVPool(caches, num_slots=2)
    pool.apply(spill=[(1, 1)], load=[])
    spilled = caches[0][:, 1].clone()
    # Block 0 is spilled to slot 0 and block 0 receives slot 1's block in the same step.
    pool.apply(spill=[(0, 0)], load=[(1, 0)])
    assert torch.equal(caches[0][:, 0], spilled)
    pool.apply(spill=[], load=[(0, 2)])
    assert torch.equal(caches[0][:, 2], old)


def test_caches_of_several_shapes_and_fp8_share_one_buffer() -> None:
    # Gemma 4's caches differ per layer kind; an FP8 cache is copied as raw bytes.
    caches = [torch.randn(2, 4, 4, 2, 3), torch.randn(2, 4, 4, 1, 8).to(torch.float8_e4m3fn)]
    before = [c.view(torch.uint8).clone() if c.dtype == torch.float8_e4m3fn else c.clone() for c in caches]
    pool = HostKVPool(caches, num_slots=2)
    assert [h.dtype for h in pool.host] == [torch.float32, torch.float8_e4m3fn]
    assert all(h.data_ptr() % 64 == 0 for h in pool.host) and pool.buffer.numel() >= HostKVPool.bytes_per_slot(caches) * 2
    pool.apply(spill=[(3, 1)], load=[])
    for c in caches:
        c.view(torch.uint8)[:, 3] = 0
    pool.apply(spill=[], load=[(1, 0)])
    assert torch.equal(caches[0][:, 0], before[0][:, 3])
    assert torch.equal(caches[1].view(torch.uint8)[:, 0], before[1][:, 3])
    assert (pool.spilled, pool.loaded) == (1, 1)
