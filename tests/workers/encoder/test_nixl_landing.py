"""The NIXL landing pool and its reader in two real processes (NIXL's UCX backend over the host's loopback, host
memory on the CPU): entries an encoder-side pool landed are read bit for bit by a model-side reader in another
process, the reader's staging buffer grows for a larger entry, and released ranges go back to the pool."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import msgspec
import torch

from ipc.landing import LandingRef, NixlLanding, is_pool_landing
from ipc.launch import new_launch_id

ENTRIES = [torch.arange(96 * 64, dtype=torch.float32).reshape(96, 64) / 7,
           (torch.arange(300 * 128) % 251).to(torch.bfloat16).reshape(300, 128)]


def encoder_side(launch_id: str, out: Any, commands: Any) -> None:
    from workers.encoder.nixl_landing import open_nixl_pool

    pool = open_nixl_pool(3, torch.device("cpu"), 1 << 20, launch_id)
    refs = [pool.land(entry) for entry in ENTRIES]
    out.put([msgspec.msgpack.encode(ref) for ref in refs])
    names = commands.get()  # the scheduler's EncodeRelease, in effect
    out.put((pool.release(names), pool.used_bytes))
    commands.get()
    pool.close()


def test_entries_cross_processes_bit_for_bit_and_ranges_come_back() -> None:
    from workers.engine.runner.nixl_reader import NixlReader

    ctx = mp.get_context("spawn")
    out, commands = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=encoder_side, args=(new_launch_id(), out, commands))
    child.start()
    try:
        refs = [msgspec.msgpack.decode(raw, type=LandingRef) for raw in out.get(timeout=60)]
        assert all(isinstance(ref, NixlLanding) and is_pool_landing(ref.name) for ref in refs)
        assert refs[0].mem == "DRAM" and refs[0].agent == refs[1].agent and refs[0].addr != refs[1].addr
        reader = NixlReader(torch.device("cpu"))
        for ref, entry in zip(refs, ENTRIES):  # the second is larger: the staging buffer is registered anew
            rows = reader.rows(ref)
            assert rows.dtype == entry.dtype and torch.equal(rows, entry)
        assert torch.equal(reader.rows(refs[0]), ENTRIES[0])  # and read again after the growth
        assert (reader.reads, reader.bytes_read) == (3, 2 * ENTRIES[0].nbytes + ENTRIES[1].nbytes)
        reader.close()
        commands.put([refs[0].name, refs[1].name, "nixl:e3xff"])  # an unknown name frees nothing
        assert out.get(timeout=30) == (2, 0)
        commands.put(None)
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
