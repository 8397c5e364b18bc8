"""Tensor-parallel benchmark: the real scheduler and model worker processes, driven over ZMQ.

The bench plays the tokenizer (it processes images and writes them to shm) and the frontend (it
reads outputs), so the numbers are the engine's: TTFT of one request with many large images, decode
throughput at a batch of 32, and the time a StepPlan takes from the scheduler's encode to each
rank's decode (pointers only, so it must not grow with image bytes).

    python -m benchmarks.engine.tp_bench --shape 7b --tp 1,2
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.args import engine_flags, parser
from benchmarks.checkpoints import shaped_checkpoint
from benchmarks.engine.engine_bench import RESOLUTIONS, messages_with, noise_image
from ipc.channels import PullSocket, PushSocket, new_context
from ipc.control import ProcessReady, RequestFailed, Shutdown
from ipc.inbound import FrontendInbound, SchedulerInbound
from ipc.launch import cleanup_launch_dir, ipc_address, new_launch_id
from ipc.outputs import OutputBatch
from ipc.prompts import MMItem, SamplingParams, TokenizedRequest
from ipc.shm import ShmSegment, segment_name, sweep
from ipc.stats import SchedulerStats
from server.config import ServerConfig
from workers.engine.config import EngineConfig
from workers.engine.offline import images_in
from workers.engine.prompt.processor import MMProcessor
from workers.model.process import host_rendezvous, run_model_worker
from workers.scheduler.process import run_scheduler


class Stack:
    """Model workers + scheduler in their own processes; this process is tokenizer and frontend."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.processor = MMProcessor(config.engine.model)
        self.ctx = new_context()
        lid = config.launch_id
        self.frontend = PullSocket[FrontendInbound](self.ctx, ipc_address(lid, "frontend"), FrontendInbound, True)
        self.to_sched = PushSocket[SchedulerInbound](self.ctx, ipc_address(lid, "sched"), SchedulerInbound, False)
        spawn = multiprocessing.get_context("spawn")
        self.procs = [spawn.Process(target=run_model_worker, args=(config, r)) for r in range(config.engine.tp_size)]
        self.procs.append(spawn.Process(target=run_scheduler, args=(config,)))
        for proc in self.procs:
            proc.start()
        self.stats: SchedulerStats | None = None
        self.names = itertools.count()
        while not isinstance(self.recv(600), ProcessReady):
            pass

    def recv(self, timeout_s: float = 600) -> FrontendInbound:
        msg = self.frontend.recv(int(timeout_s * 1000))
        if msg is None:
            raise TimeoutError("nothing from the scheduler")
        if isinstance(msg, SchedulerStats):
            self.stats = msg
        if isinstance(msg, RequestFailed):
            raise RuntimeError(f"request failed: {msg.message}")
        return msg

    def request(self, rid: str, messages: list[dict[str, Any]], sampling: SamplingParams) -> TokenizedRequest:
        dtype = self.config.engine.torch_dtype()
        processed = [self.processor.process_image(img) for img in images_in(messages)]
        prompt = self.processor.build(self.processor.render(messages), processed)
        refs = {}
        for image in processed:
            name = segment_name(self.config.launch_id, f"{image.hash.hex()}-{next(self.names)}")
            if image.hash not in refs:
                seg, refs[image.hash] = ShmSegment.create_from_tensor(name, image.pixel_values.to(dtype))
                seg.close()
        items = [MMItem(s.hash, s.offset, s.length, s.grid, refs[s.hash]) for s in prompt.spans]
        names = [ref.name for ref in refs.values()]
        nbytes = sum(ref.nbytes for ref in refs.values())
        return TokenizedRequest(rid, prompt.input_ids, prompt.mrope_delta, items, sampling, names,
                                nbytes)

    def run(self, requests: list[TokenizedRequest]) -> dict[str, list[float]]:
        """Send all, return per rid the arrival time of every output (first = TTFT reference)."""
        times: dict[str, list[float]] = {r.rid: [] for r in requests}
        t0 = time.monotonic()
        for req in requests:
            self.to_sched.send(req)
        left = set(times)
        while left:
            msg = self.recv()
            if isinstance(msg, OutputBatch):
                now = time.monotonic() - t0
                for out in msg.outputs:
                    times[out.rid].append(now)
                    if out.finish_reason is not None:
                        left.discard(out.rid)
        return times

    def worker_snapshot(self) -> dict[int, tuple[int, float]]:
        time.sleep(0.4)  # let one periodic stats message carry the workers' latest counters
        while (msg := self.frontend.recv(50)) is not None:
            if isinstance(msg, SchedulerStats):
                self.stats = msg
        assert self.stats is not None
        return {w.rank: (w.steps, w.broadcast_s_sum) for w in self.stats.workers}

    def close(self) -> None:
        self.to_sched.send(Shutdown("bench done"))
        for proc in self.procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        self.to_sched.close(linger_ms=1000)
        self.frontend.close()
        self.ctx.term()
        sweep(self.config.launch_id)
        cleanup_launch_dir(self.config.launch_id)


def bench_tp(model_dir: Path, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    engine = EngineConfig(
        model=str(model_dir), device=args.device, dtype=args.dtype, load_format="dummy", tp_size=tp,
        chunk_size=args.chunk_size, max_model_len=args.max_model_len, kv_cache_mb=args.kv_cache_mb,
        attn_backend=args.attn_backend,
    )
    rendezvous, port = host_rendezvous()
    config = ServerConfig(engine, new_launch_id(), "bench", tokenizer_workers=0, shm_budget_bytes=64 << 30,
                          log_level="warning", dist_port=port, async_scheduling=args.async_scheduling)
    stack = Stack(config)
    result: dict[str, Any] = {"tp": tp}
    try:
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        stack.run([stack.request("warm", messages_with([noise_image(448, 448, 999)], "warm"), one)])
        w, h = RESOLUTIONS["1080p"]
        ttfts = []
        for rep in range(args.ttft_repeats):  # fresh images each time: no cache may serve a repeat
            images = [noise_image(w, h, seed=rep * args.images + i) for i in range(args.images)]
            rid = f"ttft{rep}"
            t0 = time.monotonic()
            req = stack.request(rid, messages_with(images, "Summarise."), one)
            prep = time.monotonic() - t0
            ttfts.append(stack.run([req])[rid][0])
        result |= {"ttft_prompt_tokens": len(req.input_ids), "preprocess_s": prep, "ttft_s": ttfts[0], "ttfts_s": ttfts}
        if not args.decode_tokens:
            return result
        # Decode at batch 32: same-length outputs, throughput over the span where all 32 are decoding.
        decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
        batch = [stack.request(f"d{i}", [{"role": "user", "content": f"Story {i}: " + "word " * 60}], decode)
                 for i in range(32)]
        times = stack.run(batch)
        start = max(t[0] for t in times.values())
        end = max(t[-1] for t in times.values())
        tokens = sum(sum(1 for x in t if x > start) for t in times.values())
        result |= {"decode_batch": 32, "decode_tok_s": tokens / (end - start)}
        for res in filter(None, args.broadcast_res.split(",")):
            bw, bh = RESOLUTIONS[res]
            imgs = [noise_image(bw, bh, seed=100 + i) for i in range(32)]
            breq = stack.request(f"b-{res}", messages_with(imgs, "Read all."), one)
            before = stack.worker_snapshot()
            stack.run([breq])
            after = stack.worker_snapshot()
            per_rank = [(after[r][1] - before[r][1]) / max(1, after[r][0] - before[r][0]) for r in sorted(after)]
            assert stack.stats is not None
            result[f"broadcast_{res}"] = {
                "pixel_bytes": sum(i.pixels.nbytes for i in breq.items if i.pixels is not None),
                "prompt_tokens": len(breq.input_ids),
                "steps": after[0][0] - before[0][0],
                "broadcast_ms_mean_per_rank": [1e3 * x for x in per_rank],
                "plan_bytes_max": stack.stats.plan_bytes_max,
            }
    finally:
        stack.close()
        del rendezvous
    return result


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", choices=["demo", "7b"], default="7b")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    engine_flags(ap, kv_cache_mb=None)
    ap.add_argument("--ttft-repeats", type=int, default=1, help="8 x 1080p requests one after another, fresh images each")
    ap.add_argument("--broadcast-res", default="720p,1080p")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--attn-backend", default="auto", choices=["auto", "sdpa", "flash", "fa3"])
    ap.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                    help="plan each step after the one before it is back (the path TP > 1 took before session 14)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = shaped_checkpoint(Path(tmp) / "ckpt", args.shape)
        results = [bench_tp(model_dir, int(tp), args) for tp in args.tp.split(",")]
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\nshape={args.shape}, device={card}, chunk={args.chunk_size}, async scheduling={args.async_scheduling}, "
          f"attention {args.attn_backend}")
    print(f"{'tp':>3} {'TTFT s':>7} {'tokens':>7} {'decode tok/s @32':>17}  broadcast ms/step (per rank), plan bytes max")
    for r in results:
        bc = "; ".join(
            f"{k[10:]}: {', '.join(f'{x:.3f}' for x in v['broadcast_ms_mean_per_rank'])} ({v['pixel_bytes'] / 2**20:.0f} MiB px, "
            f"{v['plan_bytes_max']} B)"
            for k, v in r.items() if k.startswith("broadcast_")
        )
        decode = f"{r['decode_tok_s']:>17.1f}" if "decode_tok_s" in r else f"{'-':>17}"
        print(f"{r['tp']:>3} {r['ttft_s']:>7.3f} {r['ttft_prompt_tokens']:>7} {decode}  {bc}")
        if len(r["ttfts_s"]) > 1:
            print(f"    TTFT of each repeat (s): {', '.join(f'{x:.3f}' for x in r['ttfts_s'])}")
    if args.json:
        args.json.write_text(json.dumps({"device": card, "results": results}, indent=2))


if __name__ == "__main__":
    main()
