"""Triton's autotuner compiles its candidate configs all at once, on threads, before it times them.

Triton's ``Autotuner`` times a kernel's candidate configs one after another, and on an empty kernel cache each
candidate's first launch inside that loop is a compile (MLIR passes, LLVM, ptxas: 0.1-1 s, mostly outside the GIL),
so a kernel with twelve candidates pays twelve compiles in a row. flash-linear-attention autotunes the kernels of its
chunked gated delta rule (2-12 candidates each; the snapshot path's too), all inside a hybrid model's warm-up (a
cold Qwen3.5-9B start spent 49 s in its call sites' warm-up and 73 s in the state-snapshot paths' on an H200).

``install`` wraps the two points of ``Autotuner.run`` that see a tuning miss: ``prune_configs`` (called with the
launch's keyword arguments, which the autotuner keeps nowhere else) and ``check_disk_cache`` (handed the function
that times the candidates, called only when neither memory nor Triton's on-disk autotune cache has the key). Before
that function runs, every candidate is compiled through the kernel's ``warmup`` under Triton's ``AsyncCompileMode``
with a thread pool, which puts each compile on the pool and the finished kernels into the kernel's cache, so the
timing loop launches compiled kernels. A candidate that fails to compile fails at its launch in the timing loop as it
did before (scored out by the autotuner). Where this Triton lacks either piece, nothing is wrapped.

The timing itself is shortened too: Triton times each candidate for 125 ms (``do_bench``'s 25 ms of warm-up and 100
of repetitions), so twelve candidates take 1.5 s however fast the kernel; a tuning miss here times each for
``GLIMPSE_AUTOTUNE_BENCH_MS`` (default 25), unless the kernel brought its own timing function. The result lands in
Triton's on-disk autotune cache as before, so a restart times nothing.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

_installed = False
# Autotunes whose candidates were compiled ahead in this process, how many candidates, and the seconds spent
# compiling them and then timing them (start-up logs: what a cold start's autotunes cost).
stats: dict[str, float] = {"tunes": 0, "configs": 0, "compile_s": 0.0, "time_s": 0.0}


ENV = "GLIMPSE_AUTOTUNE_COMPILE_THREADS"
BENCH_ENV = "GLIMPSE_AUTOTUNE_BENCH_MS"
# Triton's own timing of a candidate: 25 ms of warm-up launches, then 100 ms of timed ones (triton.testing.do_bench).
# A fifth of that still times a 20 us kernel ~800 times, each after an L2 flush.
DEFAULT_BENCH_MS = 25.0
LAUNCH_KWARGS = ("grid", "warmup")


def threads() -> int:
    """Compile threads: ``GLIMPSE_AUTOTUNE_COMPILE_THREADS``, else one per core to 16 (the compiles' Python parts
    still take turns on the GIL); 1 or less compiles in turn inside the timing loop, as Triton does."""
    raw = os.environ.get(ENV, "")
    try:
        return int(raw) if raw.strip() else max(1, min(16, os.cpu_count() or 1))
    except ValueError:
        log.warning("%s=%r is not a whole number; autotune candidates compile in turn", ENV, raw)
        return 1


def bench_ms() -> float:
    """Milliseconds a candidate is timed for (a fifth warming up): ``GLIMPSE_AUTOTUNE_BENCH_MS``, else 25; 0 keeps
    Triton's own 125."""
    raw = os.environ.get(BENCH_ENV, "")
    try:
        return max(0.0, float(raw)) if raw.strip() else DEFAULT_BENCH_MS
    except ValueError:
        log.warning("%s=%r is not a number; autotune candidates are timed as Triton does", BENCH_ENV, raw)
        return 0.0


def shorten_timing(tuner: Any) -> None:
    """Time ``tuner``'s candidates for ``bench_ms()`` each, where the kernel left the timing to Triton's default."""
    ms = bench_ms()
    if ms <= 0 or getattr(tuner, "_do_bench", None) is not None:  # 0, or the kernel chose its own timing
        return
    from triton.testing import do_bench

    # do_bench is a cached_property of the Autotuner: an instance attribute of the same name takes its place
    tuner.__dict__["do_bench"] = functools.partial(do_bench, warmup=ms / 5, rep=ms * 4 / 5)


def install() -> bool:
    """Wrap Triton's autotuner once per process; whether it is wrapped."""
    global _installed
    if _installed:
        return True
    try:
        from triton.runtime import _async_compile
        from triton.runtime.autotuner import Autotuner
    except ImportError as exc:  # a Triton without the pieces: its autotunes compile as they time
        log.debug("autotune candidates compile in turn: %s", exc)
        return False
    # the shapes wrapped here: prune_configs(self, kwargs), check_disk_cache(self, tuning_key, configs, bench_fn)
    shapes = {"prune_configs": 2, "check_disk_cache": 4}
    if not hasattr(_async_compile, "AsyncCompileMode") or any(
        len(inspect.signature(getattr(Autotuner, name, None) or (lambda: None)).parameters) != count
        for name, count in shapes.items()
    ):
        log.debug("autotune candidates compile in turn: this Triton's Autotuner has another shape")
        return False
    prune, check = Autotuner.prune_configs, Autotuner.check_disk_cache

    def prune_configs(self: Any, kwargs: dict[str, Any]) -> Any:
        self._glimpse_kwargs = kwargs  # the launch's keyword arguments (heuristics' constexprs among them)
        return prune(self, kwargs)

    def check_disk_cache(self: Any, tuning_key: Any, configs: list[Any], bench_fn: Callable[[], None]) -> Any:
        def compile_then_time() -> None:
            shorten_timing(self)
            started = time.perf_counter()
            if compile_candidates(self, configs):
                compiled = time.perf_counter()
                bench_fn()
                stats["compile_s"] += compiled - started
                stats["time_s"] += time.perf_counter() - compiled
            else:
                bench_fn()

        return check(self, tuning_key, configs, compile_then_time)

    Autotuner.prune_configs = prune_configs
    Autotuner.check_disk_cache = check_disk_cache
    _installed = True
    return True


def compile_candidates(tuner: Any, configs: list[Any]) -> bool:
    """Compile ``tuner``'s candidate ``configs`` for the launch it is tuning, on threads; whether it did. Best effort:
    any failure leaves the rest to the timing loop, which compiles what is missing as it always did."""
    from triton.runtime import _async_compile
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    fn, nargs, kwargs = getattr(tuner, "fn", None), getattr(tuner, "nargs", None), getattr(tuner, "_glimpse_kwargs", None)
    workers = threads()
    nested = isinstance(fn, Autotuner)  # its warmup would tune its own candidates
    if len(configs) < 2 or workers < 2 or not isinstance(fn, KernelInterface) or nested or nargs is None or kwargs is None:
        return False
    # Autotuner.run's keyword arguments also hold the launch's own ``grid`` and ``warmup`` (``kernel[grid](...)``
    # passes them there); the kernel's arguments are the rest
    args = {name: value for name, value in {**nargs, **kwargs}.items() if name not in LAUNCH_KWARGS}
    try:
        with ThreadPoolExecutor(min(workers, len(configs)), thread_name_prefix="triton-autotune") as pool:
            # ignore_errors: a candidate that cannot compile (too much shared memory, say) raises at its launch in
            # the timing loop, where the autotuner scores it out, instead of here
            with _async_compile.AsyncCompileMode(pool, ignore_errors=True):
                for config in configs:
                    fn.warmup(grid=(1,), **args, **config.all_kwargs())
    except Exception as exc:  # noqa: BLE001 - only saves time: the timing loop compiles what is missing
        log.debug("autotune candidates of %s not compiled ahead: %s", fn, exc)
        return False
    stats["tunes"] += 1
    stats["configs"] += len(configs)
    return True
