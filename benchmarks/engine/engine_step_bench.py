"""Before/after benchmark of the engine's GPU step, in-process (no scheduler or worker processes).

Measures TTFT of one request with N x 1080p images and decode throughput at batch 32 (engine step and
``ModelRunner.execute`` alone, CUDA graphs on and, where the tree has them, off), and saves the logits of
sampled rows so that two trees can be compared. It is run as a file, so the ``workers`` package comes from
whatever tree is first on PYTHONPATH (an older checkout to get the "before" numbers):

    PYTHONPATH=/path/to/old/tree python benchmarks/engine/engine_step_bench.py --out /tmp/old.pt
    PYTHONPATH=. python benchmarks/engine/engine_step_bench.py --out /tmp/new.pt --profile
    PYTHONPATH=. python benchmarks/engine/engine_step_bench.py --compare /tmp/old.pt /tmp/new.pt
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


Step = dict[str, torch.Tensor]  # request id -> that request's logits row in one step


class Spy:
    """Wraps ``runner.sampler.sample`` (keeps each sampled request's logits row while recording) and
    ``runner.launch`` (accumulates each step's host time in launch and in its result, which ends in the sampled
    ids' host read; with asynchronous scheduling the next step is queued before a result is read)."""

    def __init__(self, runner: Any) -> None:
        self.recording = False
        self.steps: list[Step] = []
        self.execute_s: list[float] = []
        sample: Callable[..., Any] = runner.sampler.sample
        launch: Callable[[Any], Any] = runner.launch

        def sample_spy(logits: torch.Tensor, rids: list[str], params: list[Any], mask: Any = None) -> Any:
            if self.recording:
                rows = logits.to("cpu", copy=True)
                self.steps.append({rid: rows[i] for i, rid in enumerate(rids)})
            return sample(logits, rids, params, mask)

        def launch_spy(plan: Any) -> Any:
            """The step's host time: queueing it (``launch``) plus waiting for its result (``Launched.result``)."""
            t0 = time.perf_counter()
            launched = launch(plan)
            queued, result = time.perf_counter() - t0, launched.result

            def timed_result() -> Any:
                t1 = time.perf_counter()
                out = result()
                self.execute_s.append(queued + time.perf_counter() - t1)
                return out

            launched.result = timed_result
            return launched

        runner.sampler.sample = sample_spy
        runner.launch = launch_spy


def ttft_run(engine: Any, spy: Spy, seed: int, images: int, record: bool) -> dict[str, Any]:
    from benchmarks.engine.engine_bench import RESOLUTIONS, messages_with, noise_image, run_to_first_token
    from ipc.prompts import SamplingParams

    w, h = RESOLUTIONS["1080p"]
    imgs = [noise_image(w, h, seed=seed + i) for i in range(images)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    spy.recording, spy.steps = record, []
    _sync()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rid, finished, prep, ttft = run_to_first_token(engine, messages_with(imgs, "Summarise these pages."), greedy,
                                                   device)
    spy.recording = False
    return {"ttft_s": ttft, "prep_s": prep, "tokens": [list(finished[0].token_ids)], "steps": spy.steps,
            "rids": [rid], "prompt_tokens": finished[0].prompt_tokens}


def decode_run(engine: Any, spy: Spy, batch: int, tokens: int, record_steps: int) -> dict[str, Any]:
    """``batch`` text requests decoded together; throughput over the steps where all of them decode."""
    from ipc.prompts import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request([{"role": "user", "content": f"Story {i}: " + "word " * 60}], params)
            for i in range(batch)]
    spy.steps, spy.execute_s = [], []
    outputs: dict[str, list[int]] = {}
    timed: list[float] = []  # steps where all sequences decode
    execs: list[float] = []
    while len(outputs) < batch:
        all_started = all((o := engine.peek(r)) is None or len(o.token_ids) > 0 for r in rids)
        recorded = all_started and len(spy.steps) < record_steps
        spy.recording, first = recorded, len(spy.execute_s)
        t0 = time.perf_counter()
        for out in engine.step():
            outputs[out.rid] = list(out.token_ids)
        if all_started and not outputs and not recorded:  # recorded steps also copy logits to the host
            timed.append(time.perf_counter() - t0)
            execs.append(sum(spy.execute_s[first:]))
    spy.recording = False
    return {
        "tok_s": batch * len(timed) / sum(timed),
        "execute_tok_s": batch * len(execs) / sum(execs),
        "step_ms_median": 1e3 * sorted(timed)[len(timed) // 2],
        "execute_ms_median": 1e3 * sorted(execs)[len(execs) // 2],
        "tokens": [outputs[r] for r in rids],
        "steps": spy.steps,
        "rids": rids,
    }


def save(result: dict[str, Any], out: Path | None) -> None:
    """The run's numbers and sampled rows' logits, for a later --compare (nothing without --out)."""
    if out is not None:
        torch.save(result, out)


def measure(args: argparse.Namespace) -> None:
    import workers
    from benchmarks.checkpoints import shaped_checkpoint
    from benchmarks.engine.engine_bench import messages_with, noise_image
    from ipc.prompts import SamplingParams
    from workers.engine.config import EngineConfig
    from workers.engine.offline import Engine

    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"tree: {Path(workers.__file__).parent.parent}, card: {card}", flush=True)
    result: dict[str, Any] = {"card": card}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = shaped_checkpoint(Path(tmp) / "ckpt", args.shape)
        extra: dict[str, Any] = {}
        if "enable_prefix_caching" in {f.name for f in dataclasses.fields(EngineConfig)}:
            extra["enable_prefix_caching"] = False  # the old tree had none: same chunks, same roundings
        if args.lone_prefill_tokens:
            extra["lone_prefill_tokens"] = args.lone_prefill_tokens
        cfg = EngineConfig(model=str(model_dir), device=args.device, chunk_size=args.chunk_size,
                           load_format="dummy" if args.shape != "demo" else "auto",
                           kv_cache_mb=args.kv_cache_mb, max_model_len=65536, mm_cache_mb=4096,
                           block_size=args.block_size, **extra)
        t0 = time.perf_counter()
        engine = Engine(cfg)
        print(f"engine built in {time.perf_counter() - t0:.1f} s", flush=True)
        spy = Spy(engine.runner)
        one = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.generate([messages_with([noise_image(448, 448, seed=999)], "warm up")], one)
        result["ttft"] = [ttft_run(engine, spy, seed, args.images, record=True) for seed in (0, 100)]
        for r in result["ttft"]:
            print(f"TTFT {r['ttft_s']:.3f} s (prep {r['prep_s']:.3f} s, {r['prompt_tokens']} tokens)", flush=True)
        if args.ttft_only:
            if args.profile:
                profile_ttft(engine, spy, args)
            save(result, args.out)
            return
        decode_run(engine, spy, args.batch, 8, 0)  # warm-up: captures this batch's graph if the tree has graphs
        result["decode"] = decode_run(engine, spy, args.batch, args.decode_tokens, args.record_steps)
        d = result["decode"]
        print(f"decode@{args.batch}: {d['tok_s']:.0f} tok/s engine, {d['execute_tok_s']:.0f} tok/s execute, "
              f"step {d['step_ms_median']:.2f} ms, execute {d['execute_ms_median']:.2f} ms", flush=True)
        graphs = getattr(engine.runner, "graphs", None)
        if graphs is not None:
            print(f"graph stats: {graphs.stats}", flush=True)
            engine.runner.graphs = None  # same engine, eager decode
            result["decode_eager"] = d = decode_run(engine, spy, args.batch, args.decode_tokens, args.record_steps)
            print(f"decode@{args.batch} eager: {d['tok_s']:.0f} tok/s engine, {d['execute_tok_s']:.0f} tok/s "
                  f"execute, step {d['step_ms_median']:.2f} ms, execute {d['execute_ms_median']:.2f} ms", flush=True)
            engine.runner.graphs = graphs
        if args.profile:
            profile_ttft(engine, spy, args)
        if args.profile_decode:
            profile_decode(engine, spy, args)
    save(result, args.out)


def profile_decode(engine: Any, spy: Spy, args: argparse.Namespace) -> None:
    """Kernel time of ``--batch`` requests decoding 64 tokens (graph-replayed where the tree has graphs), per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        d = decode_run(engine, spy, args.batch, 64, 0)
    averages = prof.key_averages()
    busy = sum(e.self_device_time_total for e in averages) / 1e3
    print(f"profiled decode@{args.batch}: step {d['step_ms_median']:.3f} ms median; GPU kernels {busy:.1f} ms over "
          f"~64 steps (prefill included)\n{averages.table(sort_by='self_cuda_time_total', row_limit=args.profile_rows)}",
          flush=True)


def profile_ttft(engine: Any, spy: Spy, args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = ttft_run(engine, spy, 200, args.images, record=False)
    averages = prof.key_averages()
    table = averages.table(sort_by="cuda_time_total", row_limit=args.profile_rows)
    busy = sum(e.self_device_time_total for e in averages) / 1e6
    print(f"profiled TTFT {r['ttft_s']:.3f} s, GPU kernels {busy:.3f} s\n{table}", flush=True)
    if args.profile_out:
        args.profile_out.write_text(table)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def compare_runs(name: str, new: dict[str, Any], old: dict[str, Any], prefill_first: bool) -> float:
    """Logits of the same request (by position in its run) at the same recorded step, where both runs fed the
    same tokens: all earlier sampled tokens equal (``prefill_first``: step 0 follows a prefill, same inputs)."""
    worst, diff, agree, rows, steps = 0.0, 0.0, 0, 0, 0
    equal_tokens = sum(a == b for a, b in zip(new["tokens"], old["tokens"], strict=True))
    for step, (n_step, o_step) in enumerate(zip(new["steps"], old["steps"], strict=False)):
        pairs = []
        for i, (n_rid, o_rid) in enumerate(zip(new["rids"], old["rids"], strict=True)):
            if n_rid not in n_step or o_rid not in o_step:
                continue
            # Decode step s consumed the tokens sampled before it: after a prefill step 0 none; in the decode
            # batch up to a few (requests whose prefill ended in an earlier step decode in the mixed steps).
            seen = step + (0 if prefill_first else 4)
            if new["tokens"][i][:seen] == old["tokens"][i][:seen]:
                pairs.append((n_step[n_rid], o_step[o_rid]))
        if not pairs:
            continue
        a, b = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        worst, diff = max(worst, rel(a, b)), max(diff, (a - b).abs().max().item())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        rows, steps = rows + len(pairs), steps + 1
    print(f"  {name}: {equal_tokens}/{len(new['tokens'])} requests with all tokens equal; {steps} steps compared, "
          f"worst rel L2 {worst:.2e}, max |d| {diff:.3f}, argmax equal {agree}/{rows}")
    return worst


def compare(old_path: Path, new_path: Path) -> None:
    old, new = torch.load(old_path), torch.load(new_path)
    print(f"\ncorrectness (new vs old, {new['card']}):")
    worst = max(compare_runs(f"TTFT request {i}", n, o, True)
                for i, (n, o) in enumerate(zip(new["ttft"], old["ttft"], strict=True)))
    worst = max(worst, compare_runs("decode batch", new["decode"], old["decode"], False))
    if "decode_eager" in new:
        worst = max(worst, compare_runs("graph vs eager (new)", new["decode"], new["decode_eager"], False))
    print(f" worst rel L2: {worst:.2e}")
    print(f"\n{'':14}{'TTFT s (2 runs)':>18}{'decode tok/s':>14}{'execute tok/s':>15}{'step ms':>9}")
    for label, res, key in [("old", old, "decode"), ("new", new, "decode"), ("new, eager", new, "decode_eager")]:
        if key not in res:
            continue
        d = res[key]
        ttft = ", ".join(f"{r['ttft_s']:.3f}" for r in res["ttft"])
        print(f"{label:14}{ttft:>18}{d['tok_s']:>14.0f}{d['execute_tok_s']:>15.0f}{d['step_ms_median']:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="where to save the results for --compare")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("OLD", "NEW"))
    ap.add_argument("--shape", choices=["demo", "7b"], default="7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--record-steps", type=int, default=4)
    ap.add_argument("--kv-cache-mb", type=int, default=16384)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--lone-prefill-tokens", type=int, default=0, help="0: the engine default (chunk size)")
    ap.add_argument("--ttft-only", action="store_true", help="skip the decode runs")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-decode", action="store_true", help="kernel table of a decode run at --batch")
    ap.add_argument("--profile-rows", type=int, default=30)
    ap.add_argument("--profile-out", type=Path)
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        measure(args)


if __name__ == "__main__":
    main()
