"""Per-step timing records for finding where a loaded server's time goes.

Off unless ``GLIMPSE_STEP_TRACE`` names a directory. Then every process that traces (frontend, scheduler,
model worker rank 0) appends one JSON line per event to ``DIR/<role>-<pid>.jsonl``, all stamped with
``time.monotonic()`` (one clock per host), so ``benchmarks/tools/step_trace.py`` can lay the processes side by
side: when a request reached the frontend and the scheduler, how long the scheduler spent planning and
handling results, and how a model step divides into set-up, ViT, host preparation, LM forward and
sampling.

Attributing GPU time to a phase needs the host to wait for the GPU at each phase boundary (``sync``), so a
traced run loses the overlap of host preparation with queued GPU work; it is a profiling mode, not a
monitor. ``GLIMPSE_STEP_TRACE_SYNC=0`` keeps the overlap (phases are then host time only) and profiles the GPU
alone: the mode for measuring how busy the GPU is under load. The files are line-buffered: a record is on disk
as soon as it is written, whichever way the process ends.
"""

from __future__ import annotations

import atexit
import cProfile
import io
import json
import os
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

ENV = "GLIMPSE_STEP_TRACE"
# "START:COUNT,...": also run torch's profiler over those steps (counted from the process's first) and write
# its kernel table to DIR/torch-<START>.txt. Only for a process given ``sync`` (model rank 0).
PROFILE_ENV = "GLIMPSE_TORCH_PROFILE"
SYNC_ENV = "GLIMPSE_STEP_TRACE_SYNC"
# "START:COUNT,...": cProfile the model rank 0 process's Python over those steps (same counting) and
# write DIR/python-<START>.txt, the functions by own and by cumulative time: which wrappers a host-bound step's
# launches spend their time in.
PY_PROFILE_ENV = "GLIMPSE_PY_PROFILE"

# Kernel name fragments -> category, first match wins: the table's summary of where GPU time goes.
CATEGORIES = (
    ("attention", ("flash", "fmha", "cudnn", "attention", "split_kernel", "combine_kernel")),
    ("GEMM", ("nvjet", "gemm", "cutlass", "xmma", "splitkreduce", "skinny_")),
    ("memory", ("memcpy", "memset", "index_copy", "index_put", "catarray", "gather", "scatter", "direct_copy",
                "kv_write")),
    ("elementwise / norms", ("triton_", "silu", "elementwise", "reduce")),
)


def category(kernel: str) -> str:
    low = kernel.lower()
    return next((name for name, parts in CATEGORIES if any(part in low for part in parts)), "other")


def busy_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans: the time the GPU ran at least one kernel."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _windows(spec: str) -> dict[int, int]:
    """"100:3,260:3" -> {100: 3, 260: 3}."""
    out = {}
    for part in filter(None, spec.split(",")):
        start, _, count = part.partition(":")
        out[int(start)] = int(count or 1)
    return out


class StepTrace:
    def __init__(self, role: str, sync: Callable[[], None] | None = None, enabled: bool = True) -> None:
        folder = os.environ.get(ENV, "")
        self.enabled = enabled and bool(folder)
        self._gpu = sync  # a GPU process: the profile windows need it, even with the phases' syncs off
        self._sync = sync if os.environ.get(SYNC_ENV, "1") != "0" else None
        self._file: IO[str] | None = None
        self._last = 0.0
        self.phases: dict[str, float] = {}
        self._folder = Path(folder)
        self._steps = 0
        self._windows = _windows(os.environ.get(PROFILE_ENV, "")) if self.enabled and self._gpu else {}
        self._profiler: Any = None
        self._profile_end = 0
        self._py_windows = _windows(os.environ.get(PY_PROFILE_ENV, "")) if self.enabled and self._gpu else {}
        self._py: cProfile.Profile | None = None
        self._py_first = self._py_end = 0
        if self.enabled:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(folder) / f"{role}-{os.getpid()}.jsonl", "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            atexit.register(self.close)

    def begin(self) -> None:
        """Start timing one step's phases."""
        if self.enabled:
            if self._steps in self._windows:
                self._start_profiler(self._windows[self._steps])
            if self._steps in self._py_windows:
                self._py = cProfile.Profile()
                self._py_first, self._py_end = self._steps, self._steps + self._py_windows[self._steps]
                self._py.enable()
            self._steps += 1
            self.phases = {}
            self._last = self._start = time.monotonic()

    def mark(self, phase: str) -> None:
        """End ``phase`` (after the GPU work queued so far has finished, when a sync was given)."""
        if not self.enabled:
            return
        if self._sync is not None:
            self._sync()
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def end(self, **fields: Any) -> None:
        """Write the step's record: its start, its phases (seconds) and ``fields``."""
        if self.enabled:
            self.event("step", start=self._start, end=time.monotonic(), **self.phases, **fields)
            if self._profiler is not None and self._steps >= self._profile_end:
                self._stop_profiler()
            if self._py is not None and self._steps >= self._py_end:
                self._stop_py()

    def _start_profiler(self, count: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        # Without syncs the host's own speed matters, so its side (~µs per recorded op) stays off.
        cpu = [ProfilerActivity.CPU] if self._sync is not None else []
        self._profiler = profile(activities=[*cpu, ProfilerActivity.CUDA])
        self._profiler.__enter__()
        self._profile_first, self._profile_end = self._steps, self._steps + count
        self._profile_t0 = time.monotonic()

    def _stop_profiler(self) -> None:
        profiler, self._profiler = self._profiler, None
        if self._gpu is not None:
            self._gpu()  # the window's wall time covers its last kernels
        wall_ms = (time.monotonic() - self._profile_t0) * 1e3
        profiler.__exit__(None, None, None)
        events = profiler.key_averages()
        steps = self._profile_end - self._profile_first

        from torch.autograd import DeviceType

        def gpu_us(event: Any) -> float:  # kernels only: an op's row would count its kernels a second time
            if event.device_type != DeviceType.CUDA:
                return 0.0
            return float(getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0))

        lines = [f"{steps} steps from step {self._profile_first}; self GPU time per step, largest first", ""]
        ranked = sorted(events, key=gpu_us, reverse=True)
        total = sum(gpu_us(e) for e in events)
        spans = [(e.time_range.start, e.time_range.end) for e in profiler.events() if e.device_type == DeviceType.CUDA]
        busy = busy_us(spans) / 1e3
        lines.append(f"window {wall_ms:.1f} ms wall, GPU busy {busy:.1f} ms ({100 * busy / max(wall_ms, 1e-9):.1f}%)")
        by_category: dict[str, float] = {}
        for event in events:
            by_category[category(event.key)] = by_category.get(category(event.key), 0.0) + gpu_us(event)
        for key, us in sorted(by_category.items(), key=lambda kv: -kv[1]):
            if us > 0:
                lines.append(f"  {key:<24} {us / 1e3:9.1f} ms {100 * us / max(total, 1e-9):5.1f}%")
        lines.append("")
        lines.append(f"{'all kernels':<72} {total / steps / 1e3:9.3f} ms")
        for event in ranked[:40]:
            if gpu_us(event) <= 0:
                break
            share = 100 * gpu_us(event) / total
            lines.append(f"{event.key[:72]:<72} {gpu_us(event) / steps / 1e3:9.3f} ms {share:5.1f}% x{event.count // steps}")
        # The host side too: a stall with an idle GPU (a library loading kernels, a pinned allocation) shows
        # here as an op or runtime call with a large self CPU time.
        lines += ["", "self CPU time per step, largest first", ""]
        for event in sorted(events, key=lambda e: float(e.self_cpu_time_total), reverse=True)[:30]:
            lines.append(f"{event.key[:72]:<72} {event.self_cpu_time_total / steps / 1e3:9.3f} ms x{event.count / steps:.1f}")
        (self._folder / f"torch-{self._profile_first}.txt").write_text("\n".join(lines) + "\n")

    def _stop_py(self) -> None:
        """Write the Python window's functions, top 60 by own time, then by time under them (seconds, all steps)."""
        prof, self._py = self._py, None
        assert prof is not None
        prof.disable()
        parts = [f"{self._py_end - self._py_first} steps from step {self._py_first}"]
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(60)
            parts.append(f"by {key}:\n" + "\n".join(line for line in out.getvalue().splitlines() if line.strip()))
        (self._folder / f"python-{self._py_first}.txt").write_text("\n\n".join(parts) + "\n")

    def event(self, kind: str, **fields: Any) -> None:
        if self._file is None:
            return
        fields.setdefault("t", time.monotonic())
        self._file.write(json.dumps({"kind": kind, **fields}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
