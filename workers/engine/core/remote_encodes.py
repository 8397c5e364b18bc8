"""Encodes done by encoder workers (``--encoder-workers``), as the scheduling core sees them: pure bookkeeping, like
the rest of the core (the scheduler process sends the requests and receives the answers).

An image a running request will read, and which neither tier of the embedding cache holds, is *requested* as soon as
the request is admitted (or its pixels land, with overlapped media), so its encode runs ahead of the chunk that
needs it; a chunk stops short of an image not yet *landed* (``stop_at``), as it does of one still being written. A
landed entry sits in its landing segment (or CUDA pool range) until a plan imports it: ``EmbeddingCacheIndex`` admits it then exactly as
it would admit a fresh encode, and an admitted import *consumes* the landing segment (the scheduler unlinks it once
that step is over). A transient import (the cache refused the entry) leaves it landed, so a later chunk of the same
image imports it again instead of encoding it again; it goes with its last waiter.

Each key keeps the sequences waiting on it. One that ends stops waiting; a landed entry nobody waits on is unlinked,
and so is a requested one when its answer comes. A failed encode fails its waiters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ipc.landing import LandingRef
from ipc.prompts import MMItem
from ipc.steps import EmbeddingImport, EncodeItem, EncodeJob
from workers.engine.core.mm_cache import EmbeddingCacheIndex
from workers.engine.core.sequence import Sequence


@dataclass
class Requested:
    rows: int  # what the answer must hold
    waiters: set[str] = field(default_factory=set)  # sequence ids


@dataclass
class Landed:
    ref: LandingRef
    rows: int
    waiters: set[str] = field(default_factory=set)


@dataclass
class RemoteStats:
    requested: int = 0  # encode requests sent to encoder workers
    landed: int = 0  # answered with embeddings
    failed: int = 0
    imported: int = 0  # entries planned as imports (a transient one each time it is imported)
    fallbacks: int = 0  # misses a plan had no landed entry for (never expected: their step fails, no tower there)


class RemoteEncodes:
    """Which images encoder workers are encoding or have encoded, and who waits for them."""

    def __init__(self, index: EmbeddingCacheIndex) -> None:
        self.index = index
        self.requested: dict[bytes, Requested] = {}
        self.landed: dict[bytes, Landed] = {}
        self.outbox: list[EncodeJob] = []  # requests the scheduler process has not sent yet
        self.stats = RemoteStats()
        # Landing segments no plan will import (their waiters ended, or their answer was wrong): the scheduler
        # process unlinks them (deferred while a step in flight still imports one).
        self.on_unlink: Callable[[list[str]], None] | None = None

    def __contains__(self, key: bytes) -> bool:
        return key in self.landed

    # ---- requests ---------------------------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        """``seq`` is running: request every image it has still to compute that no cache tier holds."""
        for item in seq.items:
            if item.offset + item.length > seq.num_scheduled:
                self._want(seq, item)

    def stop_at(self, seq: Sequence, start: int, length: int) -> int:
        """``length`` cut before the first image [start, start + length) reads whose entry is neither cached nor
        landed (requested now if it was not): 0 when the chunk starts inside such an image."""
        if start >= seq.prompt_len:  # images sit in the prompt: a decode reads none (the common case, kept cheap)
            return length
        end = start + length
        for item in sorted(seq.items, key=lambda it: it.offset):
            if item.offset >= end or item.offset + item.length <= start or self._available(item.hash):
                continue
            self._want(seq, item)
            return max(0, item.offset - start)
        return length

    def _available(self, key: bytes) -> bool:
        return key in self.index or key in self.index.host or key in self.landed

    def _want(self, seq: Sequence, item: MMItem) -> None:
        key = item.hash
        if key in self.index or key in self.index.host:
            return
        waiting = self.landed.get(key) or self.requested.get(key)
        if waiting is not None:
            waiting.waiters.add(seq.rid)
            return
        if item.hash in seq.pending or item.pixels is None:
            return  # its pixels are not written yet: requested once they are (media_ready)
        self.requested[key] = Requested(item.length, {seq.rid})
        self.outbox.append(EncodeJob(key, [EncodeItem(item.hash, item.grid, item.length, item.pixels)]))
        self.stats.requested += 1

    def drain(self) -> list[EncodeJob]:
        out, self.outbox = self.outbox, []
        return out

    # ---- answers ----------------------------------------------------------------------------------
    def done(self, key: bytes, ref: LandingRef, rows: int) -> list[str]:
        """An encoder's entry for ``key`` landed; the sequences to fail when it holds the wrong number of rows (its
        segment then goes at once, as does one nobody waits for any more)."""
        req = self.requested.pop(key, None)
        if req is None or not req.waiters:
            self._unlink([ref.name])
            return []
        if rows != req.rows or tuple(ref.shape[:1]) != (rows,):
            self._unlink([ref.name])
            self.stats.failed += 1
            return sorted(req.waiters)
        self.landed[key] = Landed(ref, rows, req.waiters)
        self.stats.landed += 1
        return []

    def failed(self, key: bytes) -> list[str]:
        """An encoder could not encode ``key``: the sequences waiting on it, to fail."""
        self.stats.failed += 1
        req = self.requested.pop(key, None)
        return sorted(req.waiters) if req is not None else []

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended: it waits for nothing any more; landed entries nobody else waits for are unlinked."""
        gone: list[str] = []
        for item in seq.items:
            req = self.requested.get(item.hash)
            if req is not None:
                req.waiters.discard(seq.rid)
            landed = self.landed.get(item.hash)
            if landed is not None:
                landed.waiters.discard(seq.rid)
                if not landed.waiters:
                    gone.append(self.landed.pop(item.hash).ref.name)
        self._unlink(gone)

    # ---- plans ------------------------------------------------------------------------------------
    def imports(self, jobs: list[EncodeJob]) -> tuple[list[EmbeddingImport], list[EncodeJob]]:
        """A plan's encode jobs split into imports of landed entries and the jobs left to the model workers. None
        is expected: ``stop_at`` lets no chunk read an image that is neither cached nor landed, and one the host tier
        holds but the GPU tier refuses is copied from the host tier for the step (``mm_reload_once``). A job left
        anyway is counted as a fallback, and its step fails with NoVisionTower (model workers have no tower here).
        An admitted import consumes its landing segment; a transient one leaves it for the next chunk of the image."""
        imports: list[EmbeddingImport] = []
        left: list[EncodeJob] = []
        for job in jobs:
            landed = self.landed.get(job.key)
            if landed is None:
                left.append(job)
                self.stats.fallbacks += 1
                continue
            if not job.transient:
                del self.landed[job.key]
            imports.append(EmbeddingImport(job.key, landed.ref, landed.rows, job.transient))
            self.stats.imported += 1
        return imports, left

    def release_all(self) -> list[str]:
        """Every landed segment's name (the scheduler is exiting)."""
        names = [landed.ref.name for landed in self.landed.values()]
        self.landed.clear()
        return names

    def _unlink(self, names: list[str]) -> None:
        if names and self.on_unlink is not None:
            self.on_unlink(names)
