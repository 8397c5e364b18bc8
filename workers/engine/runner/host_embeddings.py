"""Worker side of the embedding cache's host tier: entries in host memory, spilled from the GPU store and reloaded
into it as each plan says (core/mm_host_tier.py is the scheduler's index of the same entries; every rank applies
the same lists, so every rank holds the same entries, as with the GPU store).

The memory is one pool reserved at start-up and cut into pages of ``PAGE_TOKENS`` rows, like the GPU store's, so the
tier's RAM is taken once and bounded. An entry owns a list of pages, allocated lowest first, so it usually sits in a
few runs of consecutive pages and moves in one copy per run. On CUDA the pool is page-locked, which lets both copies
run while the host goes on planning:

- a spill is queued on the compute stream: it reads rows that the stream's earlier work wrote, and must be done
  before later work overwrites those rows; stream order gives both. An event recorded after it tells a reload when
  the host rows are complete.
- a reload is queued on a side stream when the step starts, so it overlaps the step's ViT; the compute stream waits
  on its event before it stores the rows (``land``), which comes before the forward that reads them. Host pages a
  reload frees are written again only by a later spill, and ``spill`` makes the compute stream wait on the last
  reload first.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass

import torch

from workers.engine.core.mm_cache import PAGE_TOKENS, POOL_SLACK_PAGES, EmbeddingStore
from workers.engine.runner.pinned_host import pinned_host_memory, unpin

log = logging.getLogger("glimpse.model")


@dataclass
class HostEntry:
    rows: int
    pages: list[int]
    dense: torch.Tensor | None = None  # an entry the full pool could not take: its own tensor
    ready: torch.cuda.Event | None = None  # CUDA: recorded after the spill's copies were queued


@dataclass
class Reloading:
    """Reloads queued on the side stream and not yet stored: (key, rows on the device), and their event."""

    entries: list[tuple[bytes, torch.Tensor]]
    done: torch.cuda.Event | None
    once: int = 0  # the last ``once`` entries are for this step only (transient in the store, kept here)


class HostEmbeddings:
    """Host-memory entries of the embedding cache, keyed like the GPU store."""

    def __init__(self, pool_bytes: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        self.hidden = hidden
        self.dtype = dtype
        self.cuda = device.type == "cuda"
        self.page_bytes = PAGE_TOKENS * hidden * torch.empty((), dtype=dtype).element_size()
        # Slack for the last page of each entry, as in the GPU store, but never more than the budget itself (a
        # small tier of a wide model would otherwise be mostly slack); past it, entries get tensors of their own.
        budget_pages = -(-pool_bytes // self.page_bytes) if pool_bytes > 0 and hidden else 0
        pages = budget_pages + min(POOL_SLACK_PAGES, budget_pages)
        self.pool: torch.Tensor | None = None
        if pages:
            memory = pinned_host_memory(pages * self.page_bytes, self.cuda, "embedding host tier", "--mm-host-cache-mb")
            self.pool = memory.view(dtype).view(pages * PAGE_TOKENS, hidden)
            if self.cuda:
                # Unregistered when this object goes (the callback holds the pool: its memory outlives the pinning).
                weakref.finalize(self, unpin, self.pool)
                log.info("embedding host tier: %.1f MiB pinned", memory.numel() / 2**20)
        self._free = list(range(pages - 1, -1, -1))  # popped from the end: low pages first
        self._entries: dict[bytes, HostEntry] = {}
        self._stream = torch.cuda.Stream(device) if self.cuda and self.pool is not None else None
        self._last_reload: torch.cuda.Event | None = None
        self.spilled = 0
        self.reloaded = 0
        self.pool_misses = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held by entries (pages in use count whole)."""
        row = self.hidden * torch.empty((), dtype=self.dtype).element_size()
        return sum(e.rows * row if e.dense is not None else len(e.pages) * self.page_bytes
                   for e in self._entries.values())  # fmt: skip

    def spill(self, host_evict: list[bytes], keys: list[bytes], store: EmbeddingStore) -> None:
        """Drop ``host_evict``, then copy each of ``keys`` out of ``store`` into host memory and drop it there."""
        for key in host_evict:
            self._drop(key)
        if not keys:
            return
        if self._last_reload is not None:  # its pages may be among those written below
            torch.cuda.current_stream(self.device).wait_event(self._last_reload)
        for key in keys:
            self._drop(key)
            src = store.rows(key, 0, store.num_rows(key))
            entry = self._allocate(src.shape[0])
            if entry.dense is not None:
                entry.dense.copy_(src, non_blocking=self.cuda)
            else:
                for pool_row, first, count in _runs(entry.pages, entry.rows):
                    self._pool[pool_row : pool_row + count].copy_(src[first : first + count], non_blocking=self.cuda)
            self._entries[key] = entry
        store.evict(keys)
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
            for key in keys:
                self._entries[key].ready = ready
        self.spilled += len(keys)

    def reload(self, keys: list[bytes], once: list[bytes] | None = None) -> Reloading | None:
        """Queue the copies of ``keys`` back onto the device and drop them here; ``land`` stores them. ``once``: keys
        copied for one step only (StepPlan.mm_reload_once), kept here."""
        once = once or []
        if not keys and not once:
            return None
        out: list[tuple[bytes, torch.Tensor]] = []
        side = self._stream
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for key in [*keys, *once]:
                kept = len(out) >= len(keys)
                entry = self._entries[key] if kept else self._entries.pop(key)
                if side is not None and entry.ready is not None:
                    side.wait_event(entry.ready)
                # Allocated on the side stream, which writes it: memory the compute stream freed could still be in
                # use by its queued work, so it must not be handed to another stream's writes.
                dst = torch.empty((entry.rows, self.hidden), dtype=self.dtype, device=self.device)
                if entry.dense is not None:
                    dst.copy_(entry.dense, non_blocking=self.cuda)
                else:
                    for pool_row, first, count in _runs(entry.pages, entry.rows):
                        dst[first : first + count].copy_(self._pool[pool_row : pool_row + count], non_blocking=self.cuda)
                    if not kept:
                        self._free.extend(reversed(entry.pages))
                out.append((key, dst))
            done: torch.cuda.Event | None = None
            if side is not None:
                done = torch.cuda.Event()
                done.record(side)
        self._last_reload = done
        return Reloading(out, done, len(once))

    def land(self, reloading: Reloading | None, store: EmbeddingStore) -> None:
        """Store reloaded entries in the GPU store, after the compute stream has waited for their copies."""
        if reloading is None:
            return
        compute = torch.cuda.current_stream(self.device) if reloading.done is not None else None
        if compute is not None and reloading.done is not None:
            compute.wait_event(reloading.done)
        first_once = len(reloading.entries) - reloading.once
        for i, (key, rows) in enumerate(reloading.entries):
            if compute is not None:
                rows.record_stream(compute)  # read (and maybe kept) on the compute stream
            store.put(key, rows, transient=i >= first_once)
        self.reloaded += len(reloading.entries)

    @property
    def _pool(self) -> torch.Tensor:
        if self.pool is None:
            raise RuntimeError("the embedding host tier has no memory, but a plan spilled to it")
        return self.pool

    def _allocate(self, rows: int) -> HostEntry:
        need = -(-rows // PAGE_TOKENS)
        if self.pool is None or need > len(self._free):
            # Page rounding beyond the pool's slack: the index counted exact bytes, so the entry is still kept.
            self.pool_misses += 1
            dense = torch.empty((rows, self.hidden), dtype=self.dtype, pin_memory=self.cuda)
            return HostEntry(rows, [], dense)
        return HostEntry(rows, [self._free.pop() for _ in range(need)])

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._free.extend(reversed(entry.pages))


def _runs(pages: list[int], rows: int) -> list[tuple[int, int, int]]:
    """An entry's rows as runs over consecutive pages: (first pool row, first entry row, row count) each."""
    runs: list[tuple[int, int, int]] = []
    first = i = 0
    while first < rows:
        j = i
        while j + 1 < len(pages) and pages[j + 1] == pages[j] + 1:
            j += 1
        count = min((j - i + 1) * PAGE_TOKENS, rows - first)
        runs.append((pages[i] * PAGE_TOKENS, first, count))
        first, i = first + count, j + 1
    return runs
