"""Triton's autotuner compiles its candidate configs all at once, on threads, before it times them.

Triton's ``Autotuner`` times a kernel's candidate configs one after another, and on an empty kernel cache each
candidate's first launch inside that loop is a compile (MLIR passes, LLVM, ptxas: 0.1-1 s, mostly outside the GIL),
so a kernel with twelve candidates pays twelve compiles in a row. flash-linear-attention autotunes the kernels of its
chunked gated delta rule (2-12 candidates each; the snapshot path's too), all inside a hybrid model's warm-up (a
cold Qwen3.5-9B's fused-kernel phase took 5.5-63 s and its graph phase 10-40 s in three H200 leases; how much of
that is autotuning is still to be measured).

``install`` wraps the two points of ``Autotuner.run`` that see a tuning miss: ``prune_configs`` (called with the
launch's keyword arguments, which the autotuner keeps nowhere else) and ``check_disk_cache`` (handed the function
that times the candidates, called only when neither memory nor Triton's on-disk autotune cache has the key). Before
that function runs, every candidate is compiled through ``JITFunction.warmup`` under Triton's ``AsyncCompileMode``
with a thread pool, which puts each compile on the pool and the finished kernels into the kernel's cache, so the
timing loop launches compiled kernels. A candidate that fails to compile fails at its launch in the timing loop as it
did before (scored out by the autotuner). Where this Triton lacks either piece, nothing is wrapped.
"""

from __future__ import annotations

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


def threads() -> int:
    """Compile threads: ``GLIMPSE_AUTOTUNE_COMPILE_THREADS``, else one per core to 16 (the compiles' Python parts
    still take turns on the GIL); 1 or less compiles in turn inside the timing loop, as Triton does."""
    raw = os.environ.get(ENV, "")
    try:
        return int(raw) if raw.strip() else max(1, min(16, os.cpu_count() or 1))
    except ValueError:
        log.warning("%s=%r is not a whole number; autotune candidates compile in turn", ENV, raw)
        return 1


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
    from triton.runtime.jit import JITFunction

    fn, nargs, kwargs = getattr(tuner, "fn", None), getattr(tuner, "nargs", None), getattr(tuner, "_glimpse_kwargs", None)
    workers = threads()
    if len(configs) < 2 or workers < 2 or not isinstance(fn, JITFunction) or nargs is None or kwargs is None:
        return False
    args = {**nargs, **kwargs}
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
