"""The shared heap policy (workers/common/memory.py): glibc's numbers are readable, a trim gives freed memory
back, and the idle-trim policy trims only after idle time or huge work."""

from __future__ import annotations

import ctypes
from pathlib import Path

from workers.common.memory import IdleTrim, heap_stats, trim_memory


def _rss_kib() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1])


def test_trim_hands_freed_heap_back() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    assert (stats := heap_stats()) is not None and stats.in_use > 0
    # 32 MiB of small blocks (below any mmap threshold), touched, then freed under a block still in use, so
    # free() cannot shrink the heap's top: the pages stay resident until a trim.
    blocks = [libc.malloc(4096) for _ in range(8192)]
    for block in blocks:
        ctypes.memset(block, 1, 4096)
    fence = libc.malloc(4096)
    for block in blocks:
        libc.free(block)
    held = _rss_kib()
    trim_memory()
    libc.free(fence)
    assert held - _rss_kib() >= 16 << 10


def test_idle_trim_waits_for_idle_time_after_big_work() -> None:
    trim = IdleTrim(idle_s=10.0, big=100, huge=1000)
    assert not trim.finished(50, now=0.0, idle=True) and not trim.pending  # small work: nothing to trim
    assert not trim.finished(500, now=1.0, idle=True) and trim.pending
    assert not trim.due(now=5.0, idle=True)  # not idle long enough
    assert not trim.due(now=20.0, idle=False)  # busy again
    assert trim.due(now=11.0, idle=True) and not trim.pending  # once
    assert not trim.due(now=30.0, idle=True)
    assert trim.finished(5000, now=31.0, idle=False)  # huge: at once
