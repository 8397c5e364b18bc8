from __future__ import annotations

import pytest
import torch

from workers.engine.runner import host_kv
from workers.engine.runner.host_kv import HostKVPool

CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
)
DEVICES = ["cpu", CUDA]


@pytest.mark.parametrize("device", DEVICES)
def test_spill_then_load_round_trips_blocks(device: str) -> None:
    # Layout as the runner allocates it: (k/v, blocks, block_size, heads, head_dim) per layer.
    caches = [torch.randn(2, 5, 4, 2, 3, device=device) for _ in range(2)]
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


@pytest.mark.parametrize("device", DEVICES)
def test_spill_and_load_in_one_step_reads_before_overwrite(device: str) -> None:
    caches = [torch.randn(2, 3, 4, 1, 2, device=device)]
    old = caches[0][:, 0].clone()
    pool = HostKVPool(caches, num_slots=2)
    pool.apply(spill=[(1, 1)], load=[])
    spilled = caches[0][:, 1].clone()
    # Block 0 is spilled to slot 0 and block 0 receives slot 1's block in the same step.
    pool.apply(spill=[(0, 0)], load=[(1, 0)])
    assert torch.equal(caches[0][:, 0], spilled)
    pool.apply(spill=[], load=[(0, 2)])
    assert torch.equal(caches[0][:, 2], old)


@pytest.mark.parametrize("device", DEVICES)
def test_caches_of_several_shapes_and_fp8_share_one_buffer(device: str) -> None:
    # Gemma 4's caches differ per layer kind; an FP8 cache is copied as raw bytes.
    caches = [torch.randn(2, 4, 4, 2, 3, device=device), torch.randn(2, 4, 4, 1, 8, device=device).to(torch.float8_e4m3fn)]
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_run_on_the_mapped_pages_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three blocks per gather: a load of 10 blocks runs in 4 chunks per layer, and the result is the CPU path's.
    monkeypatch.setattr(host_kv, "_CHUNK_BYTES", 3 * 2 * 4 * 2 * 8 * 2)
    caches = [torch.randn(2, 24, 4, 2, 8, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    reference = [c.cpu() for c in caches]
    pool, ref_pool = HostKVPool(caches, num_slots=16), HostKVPool(reference, num_slots=16)
    assert pool.mapped is not None and ref_pool.mapped is None
    spill = [(b, 15 - i) for i, b in enumerate(range(2, 22, 2))]
    load = [(slot, block) for (block, slot), block in zip(spill, [1, 3, 5, 7, 9, 11, 13, 15, 17, 19], strict=True)]
    for p in (pool, ref_pool):
        p.apply(spill=spill, load=[])
        p.apply(spill=[(0, 0)], load=load)  # a spill beside loads, every block moved
    torch.cuda.synchronize()
    for c, r in zip(caches, reference, strict=True):
        assert torch.equal(c.cpu(), r)
    written = [slot for _, slot in spill] + [0]  # the other slots hold whatever the allocation held
    for twin, ref_twin in zip(pool.host, ref_pool.host, strict=True):
        assert torch.equal(twin[:, written], ref_twin[:, written])  # the host pages hold what the staged path put there
