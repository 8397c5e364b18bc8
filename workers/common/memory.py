"""Heap policy shared by the server's processes: how glibc's malloc is tuned at start, when freed memory is
handed back to the OS (malloc_trim), and the allocator's own numbers (mallinfo2) for diagnostics.

Why the tuning: glibc grows one arena per thread that allocates concurrently (up to 8 per core) and, after a
large block allocated by mmap is freed, raises its mmap threshold to that block's size (up to 32 MiB), so later
blocks of that size come from the arenas' heaps instead. A process that allocates tensors and buffers of
changing sizes from several threads (torch's intra-op pool, the image pool, asyncio's executor) then keeps the
freed holes of every arena and the RSS climbs in shrinking steps to a high-water mark far above what it holds.
A fixed threshold sends every large block to mmap, where free gives it back at once; fewer arenas keep the
small blocks' free lists shared instead of duplicated per thread.

Every function is a no-op where the C library lacks the call (musl, macOS): the process then runs untuned.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

# Blocks of this size and up are mapped on their own and unmapped on free: image buffers, pixel rows, a step's
# activations. Below it the cost of a syscall pair per block would show; above it a block is big enough that the
# page faults of a fresh mapping are small next to the work done on it. (glibc's starting value is 128 KiB; the
# point is that it stays put instead of climbing to 32 MiB.)
MMAP_THRESHOLD = 1 << 20
# Free memory above this at the top of a heap is returned by free() itself.
TRIM_THRESHOLD = 16 << 20
ARENA_MAX = 2  # the main arena and one shared by the other threads

_tuned: dict[str, int] | None = None


def _libc() -> Any:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def tune_malloc(arena_max: int = ARENA_MAX, fixed_thresholds: bool = True) -> dict[str, int]:
    """Bound glibc's arenas, and with ``fixed_thresholds`` fix its mmap and trim thresholds, for this process; call
    first thing in a process (arenas already made stay). ``GLIMPSE_MALLOC=off`` leaves glibc's defaults (a
    comparison run). Returns what was set.

    Without fixed thresholds glibc keeps adjusting its mmap threshold (setting either one stops that): a process
    that allocates the same big buffers request after request then reuses heap pages it already faulted in, where
    a fixed threshold maps and faults fresh ones for each (the cost the tokenizer's IdleTrim avoids under load)."""
    global _tuned
    if _tuned is not None:
        return _tuned
    libc = _libc()
    settings = {"arena_max": arena_max}
    if fixed_thresholds:
        settings |= {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
    if os.environ.get("GLIMPSE_MALLOC") == "off" or libc is None or not hasattr(libc, "mallopt"):
        _tuned = {}
        return _tuned
    applied = {}
    params = {"arena_max": M_ARENA_MAX, "mmap_threshold": M_MMAP_THRESHOLD, "trim_threshold": M_TRIM_THRESHOLD}
    for name, value in settings.items():
        if libc.mallopt(ctypes.c_int(params[name]), ctypes.c_int(value)) == 1:
            applied[name] = value
    _tuned = applied
    return applied


def trim_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps freed blocks of a big request otherwise, and the RSS
    of the process would stay at its peak); a no-op where malloc_trim is missing."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@dataclass(frozen=True)
class HeapStats:
    """mallinfo2, in bytes: ``heap`` obtained by sbrk/arenas, ``mapped`` in blocks mmapped on their own,
    ``in_use`` allocated (both kinds), ``free`` held free in the arenas (what a trim could give back, at most)."""

    heap: int
    mapped: int
    in_use: int
    free: int


def heap_stats() -> HeapStats | None:
    """This process's glibc heap numbers (main arena plus the others); None without mallinfo2 (glibc < 2.33)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return HeapStats(heap=info.arena, mapped=info.hblkhd, in_use=info.uordblks + info.hblkhd, free=info.fordblks)


class IdleTrim:
    """When to trim after big work. A trim returns the freed pages of a big request, so the process's RSS does not
    stay at its peak; but the next request then faults in fresh pages for every large buffer: a trim after each
    round of a multiturn chat (bodies over 4 MB from round 5 on) cost a tokenizer 12-17 ms of a round's 40 ms of
    preparation (2-core box, docs/perf-notes.md, session 18). So work past ``huge`` bytes is trimmed after at once,
    work past ``big`` once the process has been idle ``idle_s``: not between back-to-back rounds, nor under load."""

    def __init__(self, idle_s: float, big: int, huge: int) -> None:
        self.idle_s, self.big, self.huge = idle_s, big, huge
        self.pending = False
        self.idle_since = 0.0

    def finished(self, nbytes: int, now: float, idle: bool) -> bool:
        """A unit of work of ``nbytes`` ended (``idle``: it was the last in flight); True: trim now."""
        if idle:
            self.idle_since = now
        if nbytes > self.huge:
            self.pending = False
            return True
        self.pending = self.pending or nbytes > self.big
        return False

    def due(self, now: float, idle: bool) -> bool:
        """Polled by the process's loop; True (once) when a trim is pending and the process has been idle long enough."""
        if self.pending and idle and now - self.idle_since >= self.idle_s:
            self.pending = False
            return True
        return False
