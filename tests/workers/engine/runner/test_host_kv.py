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
