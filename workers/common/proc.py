"""Set-up shared by every child process: logging with the role in each line, signal policy, and the compile caches'
environment the launcher hands down."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def keep_kernel_caches() -> None:
    """Environment defaults (an explicit setting wins) that let a restarted server reuse what its GPU workers compiled
    at the last start. The launcher sets them before it starts any child: importing torch._dynamo (which a model
    worker does early) fixes Inductor's cache directory for the process, so a worker could not move it itself.

    - Triton keeps its autotuning choices in its on-disk cache beside the compiled kernels: the start-up warm-up
      autotunes flash-linear-attention's kernels for every path it runs (70 s on a fresh H200 for a Qwen3.5 model,
      warmup.py warm_state_snapshots), and without this a restarted server benchmarks them all again.
    - Inductor's cache (the compiled norm and elementwise sites: 70-98 s of a cold Qwen3.5-27B start on an H200)
      goes under ~/.cache/glimpse, as FA4's does: its default, /tmp/torchinductor_<user>, is emptied at every
      restart of a unit with PrivateTmp=yes (docker/glimpse.service) and goes with each new container."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("~/.cache/glimpse/inductor").expanduser()))


def setup_child(tag: str, level: str) -> logging.Logger:
    """Configure a child process of the launcher; returns the role's logger.

    Signals: the terminal's Ctrl-C and a process-group SIGTERM (``timeout``, ``kill -- -PGID``,
    systemd without KillMode=mixed) reach every process at once. Only the launcher acts on them: it
    drains the HTTP requests and then sends each child Shutdown, so children ignore both; a child
    that does not exit after Shutdown is killed by the launcher.
    """
    handler = logging.StreamHandler(sys.stderr)
    # Every line carries the role and rank, whichever logger (ours, the engine's, a library's) wrote it.
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per download is noise
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return logging.getLogger(tag)


class GcWatch:
    """Times the interpreter's garbage collections in this process (`gc.callbacks`): how many ran, the
    full (oldest-generation) ones, the longest and the total pause. A full collection walks every tracked object, and a serving process holds
    hundreds of thousands (torch, transformers, Dynamo's guards and graphs), so one pause can stall a step."""

    def __init__(self, frozen: int = 0) -> None:
        self.collections = 0
        self.full = 0  # of the oldest generation: the ones that walk every tracked object not frozen
        self.pause_s_sum = 0.0
        self.pause_s_max = 0.0
        # Full collections run while the process was idle (full_collections.py): kept apart, as they stall nothing.
        self.idle_full = 0
        self._off_path = False
        # What `freeze_heap` froze, kept here: `gc.get_freeze_count()` walks the whole frozen list (~37 ms for
        # 430,000 objects), so asking it per step halved a loaded server's throughput on an H200.
        self.frozen = frozen
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        if self._off_path:
            self.idle_full += info.get("generation") == 2
            return
        self.collections += 1
        self.full += info.get("generation") == 2
        self.pause_s_sum += pause
        self.pause_s_max = max(self.pause_s_max, pause)

    @contextlib.contextmanager
    def off_path(self, off: bool = True) -> Iterator[None]:
        """Collections inside count as idle ones (``off``), not in the pause figures."""
        self._off_path = off
        try:
            yield
        finally:
            self._off_path = False

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


_startup_gc: GcWatch | None = None


def watch_startup_gc() -> None:
    """Time this process's collections from now (a child's first code) until `startup_gc_summary`: a full
    collection walks every tracked object, and a model worker's start-up builds hundreds of thousands of them
    (torch, transformers, Dynamo), so its start may spend seconds in the collector."""
    global _startup_gc
    _startup_gc = GcWatch()


def startup_gc_summary() -> str | None:
    """What the collections since `watch_startup_gc` cost, as one log phrase; the watch stops. None without one."""
    global _startup_gc
    watch, _startup_gc = _startup_gc, None
    if watch is None:
        return None
    watch.close()
    return (f"{watch.collections} ({watch.full} full), {watch.pause_s_sum:.2f} s paused, longest "
            f"{1e3 * watch.pause_s_max:.0f} ms")


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection while a child imports its role; what the imports built is then frozen (out of the
    collector's reach) until `freeze_heap`. The imports alone build ~480,000 tracked objects for a model worker,
    and each of the full collections they triggered (7 on the 2-core box) walked all of them so far: 0.57 s each at
    the end. The few thousand objects the imports leave as garbage wait for `freeze_heap`'s collection."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def freeze_heap(log: logging.Logger) -> int:
    """Call once start-up is done, before announcing readiness: collect what start-up left behind, then move
    every surviving object out of the collector's reach (`gc.freeze`). Later collections then walk only what
    serving allocates. Without it a full collection under load walks the whole start-up heap: on an H200 the
    model worker's took 280-415 ms each (two or three per benchmark pass), 50-90 ms with the heap frozen."""
    started = time.perf_counter()
    gc.unfreeze()  # the imports' heap (collector_paused) too: its garbage goes now, once
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("start-up heap frozen: %d objects, %.0f ms", frozen, 1e3 * (time.perf_counter() - started))
    return frozen
