"""autotune_compiles.py: an autotune that misses every cache compiles all its candidates on threads before it times
them. On the CPU the wrapping itself (what is compiled, with which arguments, before the timing); on a GPU a real
autotune whose timing loop finds every candidate compiled."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton
import triton.language as tl
import triton.testing
from triton.runtime import _async_compile
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

from workers.engine.kernels import autotune_compiles

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b in (64, 128) for w in (1, 2)]


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, factor, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    y = x * factor if FLAG else x
    tl.store(out_ptr + offs, y, mask=offs < n)


@pytest.fixture
def wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """install() in this test only: the Autotuner's methods and the module's flag come back afterwards."""
    monkeypatch.setattr(autotune_compiles, "_installed", False)
    monkeypatch.setattr(autotune_compiles, "stats", {"tunes": 0, "configs": 0, "compile_s": 0.0, "time_s": 0.0})
    for name in ("prune_configs", "check_disk_cache"):
        monkeypatch.setattr(Autotuner, name, getattr(Autotuner, name))


def test_a_tuning_miss_compiles_every_candidate_first(wrapped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real launch through the autotuner (``tuner[grid](...)``, which hands Autotuner.run the grid and the warmup
    # flag among the keyword arguments); only the GPU's parts are stood in for: the kernel's run (compile or
    # launch), the disk cache's key (needs the driver) and the timing function.
    events: list[Any] = []

    def disk_cache_miss(self: Any, key: Any, configs: list[Any], bench_fn: Any) -> bool:
        bench_fn()  # what Triton's does on a miss
        return False

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        events.append(("compile" if warmup else "launch", _async_compile.active_mode.get() is not None, args, kwargs))

    def do_bench(kernel_call: Any, *, quantiles: Any, warmup: float, rep: float) -> list[float]:
        events.append(("timing", warmup, rep))
        kernel_call()
        return [1.0, 1.0, 1.0]

    monkeypatch.setattr(Autotuner, "check_disk_cache", disk_cache_miss)
    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    assert autotune_compiles.install() and autotune_compiles.install()  # once, however often asked
    tuner = triton.autotune(configs=CONFIGS, key=["n"], cache_results=True)(scale_kernel)
    x = torch.zeros(4)
    tuner[(1,)](x, x, 4, 2.0, FLAG=True)
    kernel_args = {"x_ptr": x, "out_ptr": x, "n": 4, "factor": 2.0, "FLAG": True}
    compiles = events[: len(CONFIGS)]
    for (what, async_mode, args, kwargs), config in zip(compiles, CONFIGS, strict=True):
        assert what == "compile" and async_mode and not args  # on the pool, every candidate
        assert kwargs == {**kernel_args, **config.all_kwargs()}
    timed = events[len(CONFIGS) :]
    # then each candidate timed for 25 ms (a fifth warming up), then the launch itself with the best
    assert timed[: 2 * len(CONFIGS) : 2] == [("timing", 5.0, 20.0)] * len(CONFIGS)
    assert [e[0] for e in timed[1 : 2 * len(CONFIGS) : 2]] == ["launch"] * len(CONFIGS)
    assert timed[-1] == ("launch", False, (x, x, 4, 2.0), {"FLAG": True, **CONFIGS[0].all_kwargs()})
    assert len(timed) == 2 * len(CONFIGS) + 1
    stats = autotune_compiles.stats
    assert (stats["tunes"], stats["configs"]) == (1, len(CONFIGS)) and stats["compile_s"] > 0 and stats["time_s"] > 0
    # one candidate: nothing to overlap, nothing compiled ahead; nor with the switch at one thread
    events.clear()
    tuner.nargs = dict(zip(tuner.arg_names, (x, x, 4, 2.0)))  # noqa: B905 - the constexprs come as keywords
    tuner.prune_configs({"FLAG": True})
    tuner.check_disk_cache(("key",), CONFIGS[:1], lambda: events.append("time"))
    assert events == ["time"]
    monkeypatch.setenv(autotune_compiles.ENV, "1")
    events.clear()
    tuner.check_disk_cache(("key",), CONFIGS, lambda: events.append("time"))
    assert events == ["time"]
    monkeypatch.setenv(autotune_compiles.ENV, "3")
    assert autotune_compiles.threads() == 3
    monkeypatch.setenv(autotune_compiles.ENV, "many")
    assert autotune_compiles.threads() == 1


def test_the_timing_is_shortened_unless_the_kernel_brings_its_own(wrapped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Autotuner, "check_disk_cache", lambda self, key, configs, bench_fn: bench_fn() or False)
    autotune_compiles.install()
    tuner = triton.autotune(configs=CONFIGS, key=["n"])(scale_kernel)
    monkeypatch.setenv(autotune_compiles.ENV, "1")  # no compiles ahead here
    monkeypatch.setenv(autotune_compiles.BENCH_ENV, "50")
    tuner.check_disk_cache(("key",), CONFIGS, lambda: None)
    bench = tuner.do_bench
    assert bench.func is triton.testing.do_bench and bench.keywords == {"warmup": 10.0, "rep": 40.0}
    own = triton.autotune(configs=CONFIGS, key=["n"], do_bench=lambda fn, quantiles: [1.0])(scale_kernel)
    own.check_disk_cache(("key",), CONFIGS, lambda: None)
    assert "do_bench" not in own.__dict__  # the kernel's own timing stays
    monkeypatch.setenv(autotune_compiles.BENCH_ENV, "0")  # Triton's own 125 ms
    plain = triton.autotune(configs=CONFIGS, key=["n"])(scale_kernel)
    plain.check_disk_cache(("key",), CONFIGS, lambda: None)
    assert "do_bench" not in plain.__dict__
    monkeypatch.setenv(autotune_compiles.BENCH_ENV, "soon")
    assert autotune_compiles.bench_ms() == 0.0


def test_a_failed_compile_ahead_leaves_the_timing_to_compile(wrapped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[str] = []

    def warmup(self: Any, *args: Any, grid: Any, **kwargs: Any) -> None:
        raise TypeError("a Triton whose warmup takes other arguments")

    monkeypatch.setattr(Autotuner, "check_disk_cache", lambda self, key, configs, bench_fn: bench_fn() or False)
    monkeypatch.setattr(JITFunction, "warmup", warmup)
    autotune_compiles.install()
    tuner = triton.autotune(configs=CONFIGS, key=["n"])(scale_kernel)
    tuner.nargs = {"x_ptr": None, "out_ptr": None, "n": 4, "factor": 2.0}
    tuner.prune_configs({"FLAG": True})
    tuner.check_disk_cache(("key",), CONFIGS, lambda: timed.append("time"))
    assert timed == ["time"] and autotune_compiles.stats == {"tunes": 0, "configs": 0, "compile_s": 0.0, "time_s": 0.0}


def test_an_autotuner_of_another_shape_is_left_alone(wrapped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def check_disk_cache(self: Any, tuning_key: Any, bench_fn: Any) -> bool:  # a Triton whose method differs
        return False

    monkeypatch.setattr(Autotuner, "check_disk_cache", check_disk_cache)
    assert not autotune_compiles.install()
    assert Autotuner.check_disk_cache is check_disk_cache


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton's compiler and driver)")
def test_a_real_autotune_times_compiled_candidates(
    wrapped: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # An empty kernel cache and autotune cache: the timing loop's first launch finds all four candidates in the
    # kernel's cache, and the tuned kernel computes what it should.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernel = triton.jit(scale_kernel.fn)  # a JITFunction of its own: no kernel cached in this process yet
    tuner = triton.autotune(configs=CONFIGS, key=["n"], cache_results=True)(kernel)
    device = torch.cuda.current_device()
    compiled_before_timing: list[int] = []
    compile_candidates = autotune_compiles.compile_candidates

    def compile_and_count(tuner: Any, configs: list[Any]) -> None:
        compile_candidates(tuner, configs)
        compiled_before_timing.append(len(kernel.device_caches[device][0]))

    monkeypatch.setattr(autotune_compiles, "compile_candidates", compile_and_count)
    assert autotune_compiles.install()
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    tuner[lambda meta: (triton.cdiv(1000, meta["BLOCK"]),)](x, out, 1000, 3.0, FLAG=True)
    assert compiled_before_timing == [len(CONFIGS)]
    torch.testing.assert_close(out, x * 3)
    assert (autotune_compiles.stats["tunes"], autotune_compiles.stats["configs"]) == (1, len(CONFIGS))
