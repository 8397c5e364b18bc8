"""Opt-in memory diagnostics of a model worker: ``GLIMPSE_MEM_DIAG=<dir>`` makes each worker append one JSON
line every ``GLIMPSE_MEM_DIAG_S`` seconds (default 10) to ``<dir>/model<index>.jsonl``: RSS, glibc's heap numbers
(in use vs. held free: a leak grows the first, fragmentation the second), the sizes of the runner's per-request
books, and with ``GLIMPSE_MEM_DIAG_TRACE=1`` the Python allocation sites that grew most since the first line
(tracemalloc; it slows the worker, so it is off unless asked). Off by default: nothing runs, nothing is imported.
"""

from __future__ import annotations

import json
import os
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from workers.common.memory import heap_stats


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start(index: int, books: Callable[[], dict[str, int]]) -> threading.Thread | None:
    """Start the sampling thread if ``GLIMPSE_MEM_DIAG`` is set; ``books`` returns the sizes to record."""
    out_dir = os.environ.get("GLIMPSE_MEM_DIAG")
    if not out_dir:
        return None
    every = float(os.environ.get("GLIMPSE_MEM_DIAG_S", "10"))
    trace = os.environ.get("GLIMPSE_MEM_DIAG_TRACE") == "1"
    path = Path(out_dir) / f"model{index}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if trace:
        tracemalloc.start(8)

    def loop() -> None:
        first = tracemalloc.take_snapshot() if trace else None
        started = time.monotonic()
        while True:
            heap = heap_stats()
            row: dict[str, Any] = {"t": round(time.monotonic() - started, 1), "rss_mib": _rss_mib(),
                                   "heap": asdict(heap) if heap else None, "books": books()}
            if first is not None:
                top = tracemalloc.take_snapshot().compare_to(first, "traceback")[:8]
                row["grew"] = [{"kib": s.size_diff // 1024, "count": s.count_diff,
                                "where": [f"{f.filename}:{f.lineno}" for f in s.traceback][-4:]} for s in top]
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            time.sleep(every)

    thread = threading.Thread(target=loop, name="mem-diag", daemon=True)
    thread.start()
    return thread
