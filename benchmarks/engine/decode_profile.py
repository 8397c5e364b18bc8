"""Where a decode step's GPU time goes: the offline Engine at a real shape (dummy bf16 weights, decode CUDA
graphs, `glimpse serve`'s KV block size), ``--batch`` greedy sequences of ``--context`` prompt tokens (default one
of ~50), the median step once all are decoding (host sync after each) and the kernels of 17 steps under the
profiler, per step. ``--variants`` runs the shape once per variant in one process (VARIANTS: the served
configuration with one switch turned, e.g. the elementwise work eager instead of fused). ``--phase prefill`` profiles
the prefill steps instead: ``--batch`` fresh text prompts of ``--context`` tokens in steps of ``--chunks`` tokens
(default ``glimpse serve``'s 4,096; a list runs each), with their prefill tokens per second. ``--pieces`` sets the
largest step the piecewise CUDA graphs take (a list runs each). Every prompt opens with
a word of its own, so no two share a cached prefix.

    python -m benchmarks.engine.decode_profile --shape qwen3.5-35b-a3b --layers 20
    python -m benchmarks.engine.decode_profile --shape qwen3.5-35b-a3b --layers 20 --variants "moe separate,as served" --top 0
    python -m benchmarks.engine.decode_profile --shape gemma4-26b-a4b --layers 12 --variants "eager elementwise,as served"
    python -m benchmarks.engine.decode_profile --shape qwen3-8b --layers 0 --quantize fp8-block
    python -m benchmarks.engine.decode_profile --shape qwen3-8b --layers 0 --variants "split sums apart,as served"
    python -m benchmarks.engine.decode_profile --shape qwen3-8b --layers 0 --batch 64 --context 2200  # (b)'s decodes
    python -m benchmarks.engine.decode_profile --shape qwen3.5-27b --layers 32 --phase prefill --batch 8 --context 2200
    python -m benchmarks.engine.decode_profile --shape qwen3.5-27b --layers 32 --phase prefill --batch 8 --context 6600 --waits
    python -m benchmarks.engine.decode_profile --shape qwen3.5-35b-a3b --layers 20 --phase prefill --batch 8 --context 2200 --chunks 2048,4096
    python -m benchmarks.engine.decode_profile --shape qwen3.5-35b-a3b --layers 20 --phase prefill --batch 8 --context 2200 --chunks 2048 --pieces 0,2048

``--waits`` also records the host side of the profiled steps and lists the CUDA runtime calls the host waited in
(a synchronize, a copy to or from pageable memory), by the code that made them: each is a point where the GPU's queue
runs dry, so the step's wall time exceeds its kernel time by at least the launches that follow it.

``--python`` (prefill) runs the same steps once more under cProfile and lists the host's Python time by function:
where the launches of the eager stretches between captured pieces spend it (fla's and Triton's wrappers included).

``--quantize`` serves the shape as that FP8 checkpoint (benchmarks/checkpoints.py) with its FP8 layers on
(the default ``GLIMPSE_FP8_GEMM=auto``, or the variant the environment names), to set its decode kernels beside bf16's.

The second engine of a process runs beside the first one's leftover threads: compare kernel time, not step wall time,
or run one variant per process. (Variants that overlap kernels on two streams show only in step time.)
"""

from __future__ import annotations

import cProfile
import gc
import io
import itertools
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from ipc.prompts import SamplingParams
from workers.engine.config import EngineConfig, serving_kv_blocks
from workers.engine.kernels import fp8_gemm, fused, pdl, split_norm
from workers.engine.models.gemma4 import moe as gemma4_moe
from workers.engine.models.qwen3_5.moe import SharedExpertMoeBlock
from workers.engine.offline import Engine
from workers.engine.runner import warmup
from workers.engine.runner.piecewise_split import Splitter


def prompt(context: int, tag: str) -> list[dict[str, str]]:
    """A one-message chat of about ``context`` tokens ("the" is one token of the shape checkpoints' demo tokenizer;
    "hello", which this used before, is three), opened by ``tag``: each sequence its own, so that no two share a
    cached prefix (shared KV blocks would be read from L2, and the decode attention would look cheaper than under
    (b)'s load, where every request has its own image)."""
    return [{"role": "user", "content": f"{tag} " + "the " * max(1, context - 1)}]


_tags = itertools.count()  # the decode runs' prompt tags: no run shares a prefix with another


def checkpoint(shape: str, layers: int, scratch: Path, quantize: str | None = None) -> Path:
    return shaped_checkpoint(scratch / shape, shape, layers=layers, quantize=quantize)


def decode(engine: Engine, tokens: int, batch: int = 1, context: int = 50, prof: profile | None = None) -> list[float]:
    """Seconds of each of ``tokens`` steps once every sequence has its first token, all ``batch`` greedy sequences
    decoding in each; their prefills run (untimed, and outside ``prof``'s window) first. A sequence whose prompt is
    done decodes on while later ones prefill, so each may take that many tokens more: none ends inside the timed steps
    (at 64 x 2,200 tokens most had ended before them, and the "batch 64" steps had a handful of rows). The rest are
    aborted after them."""
    slack = -(-batch * (context + 16) // engine.config.chunk_size) + batch + 2  # tokens a prefill step may give
    sampling = SamplingParams(max_tokens=tokens + slack, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(prompt(context, f"d{next(_tags)}"), sampling) for _ in range(batch)]
    while any((out := engine.peek(rid)) is not None and not out.token_ids for rid in rids):  # None: finished
        if engine.step():
            raise RuntimeError("a sequence ended before the others had their first token: raise the slack")
    steps = timed_steps(engine, 0, prof, steps=tokens)
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return steps


def prefill(
    engine: Engine, batch: int, context: int, tag: str, prof: profile | PythonProfile | None = None
) -> list[float]:
    """Seconds of each step that prefills ``batch`` prompts of about ``context`` tokens, each opened by a word of
    its own (``tag`` and its index: no prefix of another run's prompts is cached), until every one has its token."""
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(prompt(context, f"{tag}{i}"), sampling)
    return timed_steps(engine, batch, prof)


class PythonProfile:
    """cProfile over the same window as the torch profiler (``start``/``stop``): the host's Python time by function,
    fla's and Triton's launch wrappers included, which the torch profiler attributes to no op."""

    def __init__(self) -> None:
        self.prof = cProfile.Profile()

    def start(self) -> None:
        self.prof.enable()

    def stop(self) -> None:
        self.prof.disable()

    def print(self, steps: int, top: int) -> None:
        """The ``top`` functions by own time and by time under them, in ms per step (cProfile's own cost included:
        read the shares, not the sums)."""
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            stats = pstats.Stats(self.prof, stream=out)
            stats.sort_stats(key).print_stats(top)
            print(f"\nPython by {key} over {steps} steps (seconds, all steps):")
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[-12000:])


def timed_steps(
    engine: Engine, requests: int, prof: profile | PythonProfile | None, steps: int | None = None
) -> list[float]:
    """Seconds of each step (host sync after each) until ``requests`` more requests have finished (or, given
    ``steps``, for that many steps, none of which may finish one), all of them inside ``prof``'s window when given."""
    torch.cuda.synchronize()
    if prof is not None:
        prof.start()
    times: list[float] = []
    finished = 0
    while (finished < requests) if steps is None else (len(times) < steps):
        t0 = time.perf_counter()
        done = len(engine.step())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if done and steps is not None:
            raise RuntimeError("a sequence ended inside the timed decode steps")
        finished += done
    if prof is not None:
        prof.stop()
    return times


# CUDA runtime calls in which the host can wait for the GPU (a memcpy waits when either side is pageable memory).
WAITING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                 "cudaMemcpyAsync")


def _caller(event: Any) -> str:
    """The repo and fla frames of the nearest enclosing op that carries a Python stack (runtime calls carry none);
    without stacks recorded, the names of the enclosing ops."""
    parent = event.cpu_parent
    while event is not None and not event.stack:
        event = event.cpu_parent
    frames = [f.split("/")[-1] for f in (event.stack if event is not None else [])
              if f.startswith(("workers/", "benchmarks/")) or "/workers/" in f or "/fla/" in f]  # fmt: skip
    if not frames:
        while parent is not None and len(frames) < 3:
            frames.append(parent.name)
            parent = parent.cpu_parent
    return " < ".join(frames[:4]) or "?"


def print_host_ops(prof: profile, steps: int, top: int) -> None:
    """The host's own time per step by op (CPU self time: dispatch, launches, Python-side kernel wrappers)."""
    ops = [e for e in prof.key_averages() if e.device_type.name == "CPU"]
    print("\n| host op | calls per step | host self ms per step |\n|---|---|---|")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"| {e.key[:90]} | {e.count / steps:.1f} | {e.self_cpu_time_total / 1e3 / steps:.3f} |")
    # The kernels each op launched (eager ops; a graph replay's kernels count under its launch): which op a generic
    # kernel of the table above (an elementwise or copy kernel) came from.
    print("\n| op | calls per step | its kernels' ms per step |\n|---|---|---|")
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:top]:
        if e.self_device_time_total > 0:
            print(f"| {e.key[:90]} | {e.count / steps:.1f} | {e.self_device_time_total / 1e3 / steps:.3f} |")


def print_waits(prof: profile, steps: int, floor_ms: float = 0.05) -> None:
    """The runtime calls of WAITING_CALLS that took more than ``floor_ms`` of host time a step, by the code that
    made them."""
    totals: dict[tuple[str, str], list[float]] = {}
    for e in prof.events():
        if e.name in WAITING_CALLS:
            row = totals.setdefault((e.name, _caller(e)), [0, 0.0])
            row[0] += 1
            row[1] += e.time_range.elapsed_us() / 1e3
    print("\n| host wait | calls per step | host ms per step | called from |\n|---|---|---|---|")
    for (name, caller), (count, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        if ms / steps >= floor_ms:
            print(f"| {name} | {count / steps:.1f} | {ms / steps:.3f} | {caller} |")


def measure(
    ck: Path, top: int, batch: int = 1, context: int = 50, phase: str = "decode", waits: bool = False,
    chunk: int = 4096, host: bool = False, pieces: int | None = None, python: bool = False,
) -> tuple[float, float, float]:
    """(median step ms, kernel ms per step, kernels per step) of ``phase``'s steps of at most ``chunk`` tokens,
    printing the ``top`` kernels (with ``waits``, where the host waited for the GPU, by Python caller; with ``host``,
    the same by enclosing op and the host's time by op, without the cost of recording stacks). ``pieces``: the
    engine's piecewise_graph_tokens (None: its default); ``python``: the host's Python time by function over one
    more run of the same prefill steps."""
    kv_mb = max(4096, batch * (context + 128) * 160 // 1024)  # ~160 KiB of KV a token covers the 8B shapes
    block_size, _ = serving_kv_blocks("cuda", "auto", None, None)  # `glimpse serve`'s blocks: the decode kernel's
    # time depends on them (64 x 2,200 keys on an H200: 0.28 ms a layer in 16-token blocks, 0.15 in 128-token ones)
    started = time.perf_counter()
    engine = Engine(EngineConfig(model=str(ck), device="cuda", dtype="bfloat16", load_format="dummy",
                                 kv_cache_mb=kv_mb, max_model_len=max(8192, context + 256),
                                 max_num_seqs=max(batch, 1), block_size=block_size, chunk_size=chunk,
                                 lone_prefill_tokens=chunk, piecewise_graph_tokens=pieces))  # fmt: skip
    print(f"engine started in {time.perf_counter() - started:.1f} s")
    # One phase's steps only (a prefill's would swamp decodes); with ``waits`` the host side too, whose Python
    # stacks the profiler keeps only in its verbose mode.
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if waits or host else [])]
    prof = profile(activities=activities, with_stack=waits,
                   experimental_config=_ExperimentalConfig(verbose=True) if waits else None)
    if phase == "prefill":
        prefill(engine, batch, context, "warm")  # first use: compiles, autotuning
        steps = prefill(engine, batch, context, "timed")
        print(f"prefill: {batch} x ~{context} tokens in {len(steps)} steps of <= {chunk}, {sum(steps):.3f} s, "
              f"{batch * context / sum(steps):,.0f} tokens/s")
        n = len(prefill(engine, batch, context, "profiled", prof))
        steps.sort()
        if python:
            pyprof = PythonProfile()
            pyprof.print(len(prefill(engine, batch, context, "python", pyprof)), top)
    else:
        decode(engine, 8, batch, context)
        steps = sorted(decode(engine, 96, batch, context)[2:])
        n = len(decode(engine, 17, batch, context, prof))
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"| {e.key[:90]} | {e.count / n:.1f} | {e.self_device_time_total / 1e3 / n:.4f} |")
    if engine.runner.piecewise is not None:
        print(f"piecewise graphs: {engine.runner.piecewise.stats}")
    if waits or host:
        print_waits(prof, n)
    if host:
        print_host_ops(prof, n, top)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return (steps[len(steps) // 2] * 1e3, sum(e.self_device_time_total for e in kernels) / 1e3 / n,
            sum(e.count for e in kernels) / n)  # fmt: skip


class _NoFused:
    """fused.py as warm_fused sees it, with ``enable`` switching nothing: every site stays eager."""

    def __getattr__(self, name: str) -> object:
        return getattr(fused, name)

    @staticmethod
    def enable(module: torch.nn.Module, on: bool = True) -> int:
        return 0


# Variants: what each one sets (owner, attribute, value) before its engine starts, undone after it.
VARIANTS: dict[str, tuple[tuple[object, str, object], ...]] = {
    "as served": (),
    # Qwen3.5-MoE's shared expert gate_up, router and shared gate as three projections, not one matmul
    "moe separate": ((SharedExpertMoeBlock, "join", lambda self: False),),
    # the elementwise work between the GEMMs eager (warm_fused switches the flags on through warmup's reference)
    "eager elementwise": ((warmup, "fused", _NoFused()),),
    # Gemma 4 MoE: the dense MLP after the experts on one stream, not beside them
    "mlp after experts": ((gemma4_moe, "OVERLAP_DENSE_MLP", False),),
    # decode projections that split K sum their partials in a kernel of their own, not in the next norm's
    "split sums apart": ((split_norm, "available", lambda: False),),
    # RMSNorms of plain rows through the compiled add + norm (Dynamo's guards on every call), not the Triton kernel
    "compiled norms": ((split_norm, "rows_available", lambda: False),),
    # every kernel launched plainly: each starts only once the one before has finished (no programmatic launch)
    "no PDL": ((pdl, "enabled", lambda device: False),),
    # piecewise graphs: Gated DeltaNet's q|k|v copied out of the input projection into a buffer of their own, as
    # before the projection's GEMM wrote into the static buffer itself
    "qkv copied": ((Splitter, "linear_projection", None),),
}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, default=20, help="decoder layers kept (0: all)")
    ap.add_argument("--top", type=int, default=30, help="kernels listed per run, by time")
    ap.add_argument("--variants", default="as served", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--quantize", choices=("fp8-block", "fp8-dynamic"), help="serve the shape as this FP8 checkpoint")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    ap.add_argument("--context", type=int, default=50, help="prompt tokens of each sequence")
    ap.add_argument("--phase", choices=("decode", "prefill"), default="decode", help="the steps profiled")
    ap.add_argument("--waits", action="store_true", help="list the runtime calls the host waited in, by caller")
    ap.add_argument("--host", action="store_true", help="the host's waits by enclosing op and its time by op (no stacks)")
    ap.add_argument("--python", action="store_true", help="prefill: the host's Python time by function (cProfile)")
    ap.add_argument("--chunks", default="4096", help="comma-separated step token budgets, each run per variant")
    ap.add_argument("--pieces", default="", help="comma-separated piecewise_graph_tokens, each run per variant and "
                    "budget (empty: the config's default)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        ck = checkpoint(args.shape, args.layers, Path(scratch), args.quantize)
        pieces = [int(p) if p else None for p in args.pieces.split(",")]
        for name, chunk, most in itertools.product(args.variants.split(","), map(int, args.chunks.split(",")), pieces):
            saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in VARIANTS[name]]
            for owner, attr, value in VARIANTS[name]:
                setattr(owner, attr, value)
            label = f"{name}, <= {chunk}" + ("" if most is None else f", pieces to {most}")
            if args.top:
                print(f"\n{label}:\n| kernel | per step | ms per step |\n|---|---|---|")
            rows.append((label, *measure(ck, args.top, args.batch, args.context, args.phase, args.waits, chunk,
                                         args.host, most, args.python)))
            for owner, attr, value in saved:
                setattr(owner, attr, value)
    fp8 = f", {args.quantize} under {fp8_gemm.VARIANT_ENV}={fp8_gemm.variant()}" if args.quantize else ""
    print(f"\n{args.shape} ({args.layers or 'all'} layers{fp8}), {args.phase}, batch {args.batch}, {args.context}-token prompts, "
          f"{torch.cuda.get_device_name()}")
    print("\n| variant | step, ms | kernel time per step, ms | kernels per step |\n|---|---|---|---|")
    for name, step, kernel_ms, count in rows:
        print(f"| {name} | {step:.3f} | {kernel_ms:.3f} | {count:.0f} |")


if __name__ == "__main__":
    main()
