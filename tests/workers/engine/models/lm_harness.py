"""What the decoder tests of every family share: a paged KV cache whose blocks are handed out in shuffled order (so
block tables are never contiguous), and tensor-parallel ranks run as real processes over gloo on the CPU."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels.attention import AttentionMetadata, build_attention_metadata
from workers.engine.layers.linear import TPGroup

BLOCK_SIZE = 4


@dataclass
class PagedCache:
    """The KV caches of ``model`` (a PagedDecoder) and the block tables of the sequences run through them."""

    model: Any
    seed: int = 0
    num_blocks: int = 48
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    caches: list[Tensor] = field(init=False)
    free: list[int] = field(init=False)
    tables: dict[str, list[int]] = field(default_factory=dict)
    done: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        shape = self.model.kv_cache_shape(self.num_blocks, BLOCK_SIZE)
        self.caches = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.model.layers]
        self.free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free)

    def schedule(self, chunks: list[tuple[str, int]]) -> tuple[AttentionMetadata, list[int]]:
        """One flattened step over ``(seq, n_new_tokens)`` chunks: grow each sequence's block table for its new
        tokens; returns the step's attention metadata and where each chunk starts in its sequence."""
        q_lens, s_lens, tables, starts = [], [], [], []
        for seq, n in chunks:
            start = self.done.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < start + n:
                table.append(self.free.pop())
            q_lens.append(n)
            s_lens.append(start + n)
            tables.append(table)
            starts.append(start)
            self.done[seq] = start + n
        return build_attention_metadata(q_lens, s_lens, tables, BLOCK_SIZE, device=self.device), starts


def _rank_main(rank: int, world: int, port: int, out: str, work: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """One TP rank over gloo: ``work(tp, *args)``, its result saved for the parent."""
    import faulthandler

    import torch.distributed as dist

    # A rank that dies in native code leaves its reason here (pytest does not capture children).
    err = open(Path(out) / f"rank{rank}.stderr", "w")  # noqa: SIM115 - lives as long as the process
    os.dup2(err.fileno(), 2)
    faulthandler.enable(err)
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # ranks talk over loopback only, whatever the host's name resolves to
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        tp = TPGroup(rank=rank, size=world, group=dist.group.WORLD)
        torch.save(work(tp, *args), Path(out) / f"rank{rank}.pt")
        # Everyone done before anyone tears down: a rank leaving early makes gloo abort its peers.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and saved: skip the interpreter's teardown, where gloo's threads once aborted a rank ("terminate called
    # without an active exception") after every rank had saved its result (a CI run, session 18).
    err.flush()
    os._exit(0)


def run_tp_ranks(work: Callable[..., Any], world: int, out: Path, *args: Any) -> list[Any]:
    """``work(tp, *args)`` (a module-level function, so the spawned ranks can import it) on ``world`` real TP ranks,
    one process each; returns every rank's result, in rank order. ``out`` holds the results and each rank's stderr,
    printed if a rank fails."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # The test serves the rendezvous store on a port the OS picked: nothing to race other tests for.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        mp.spawn(_rank_main, args=(world, int(store.port), str(out), work, args), nprocs=world, join=True)
    except Exception:
        for log in sorted(out.glob("rank*.stderr")):
            print(f"--- {log.name}\n{log.read_text()}")
        raise
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]
