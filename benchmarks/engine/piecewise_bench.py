"""Small steps with and without the piecewise CUDA graphs (workers/engine/runner/piecewise_graphs.py), one engine in-process
on a checkpoint of a real model's shape with dummy weights. The graphs are switched per run (``runner.piecewise``), so
both columns come from the same process, alternating. Prints two tables:

1. a request's time to its first token (one step of new tokens, then one sampled token): a short prompt alone, a
   few new tokens over a cached context (the base prompt, prefilled before), and a small new image with a few words
   (its ViT call included; Qwen3-VL's image steps take the pieces captured with DeepStack features);
2. a text load: a new ~60-word prompt joins at each step while up to ``--running`` others decode 64 tokens each.

Three variants: the graphs as served (each piece writes its layer's new K/V into the cache), the same graphs with the
K/V written by the eager attention between pieces, and no piecewise graphs.

Measured (session 23, H200, 7B shape): a 37-token prompt 6.7 against 19.1 ms, 173 tokens 8.7 against 23.3 ms,
44 new tokens over a 15k-token context 28.4 against 41.7 ms (its tokenizing included); the text load 73-74 against
41-43 req/s.

    python -m benchmarks.engine.piecewise_bench --shape 7b
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from ipc.prompts import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine
from workers.engine.runner import piecewise_graphs

WORDS = ("river", "stone", "paper", "light", "green", "house", "table", "cloud", "metal", "water", "sound", "glass")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", default="7b", help="benchmarks.checkpoints shape")
    ap.add_argument("--base-words", type=int, default=3500, help="the cached context (~15k tokens at 3500)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--load-requests", type=int, default=160)
    ap.add_argument("--running", type=int, default=48)
    ap.add_argument("--limit", type=int, help="--piecewise-graph-tokens of the engine (default: the model's)")
    args = ap.parse_args()
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(n))

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = shaped_checkpoint(Path(tmp) / "ckpt", args.shape)
        cfg = EngineConfig(model=str(ckpt), device="cuda", load_format="dummy", kv_cache_mb=24576, max_model_len=32768,
                           mm_cache_mb=1024, block_size=128, max_num_seqs=128,
                           piecewise_graph_tokens=args.limit)
        engine = Engine(cfg, async_scheduling=True)
        pieces = engine.runner.piecewise
        if pieces is None:
            raise SystemExit("no piecewise graphs in this engine (CUDA only; see the worker's log)")
        print(f"{torch.cuda.get_device_name()}, {args.shape}: {pieces.stats['captures']} piecewise graphs, buckets up "
              f"to {pieces.buckets_in_use[-1]} tokens", flush=True)
        r = engine.runner  # the same graphs with each layer's K/V written by the eager attention instead
        kv_eager = piecewise_graphs.build(r.lm, r.lm.attention_backend(r.device), r.kv_caches, pieces.embeds.shape[1],
                                          pieces.buckets_in_use[-1], r.dtype, 1, None,
                                          deepstack_levels=pieces.ds_levels)
        variants = {"graphs": pieces, "graphs, K/V eager": kv_eager, "eager": None}
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def first_token(text: str, image: Image.Image | None = None) -> float:
            content: list[dict[str, Any]] = [{"type": "text", "text": text}]
            if image is not None:
                content.insert(0, {"type": "image", "image": image})
            torch.cuda.synchronize()
            started = time.perf_counter()
            engine.add_request([{"role": "user", "content": content}], first)
            while not engine.step():
                pass
            torch.cuda.synchronize()
            return (time.perf_counter() - started) * 1e3

        base = words(args.base_words)
        for _ in range(2):
            first_token(base)  # cached from here on
        tokenizer = engine.processor.tokenizer
        print(f"{'case':16} {'new tokens':>10} " + " ".join(f"{name + ' ms':>20}" for name in variants)
              + f"  (medians of {args.repeats})")
        cases = [("short prompt", 8), ("short prompt", 40), ("short prompt", 100), ("over the base", 10),
                 ("over the base", 40), ("over the base", 100), ("over the base", 160)]
        if args.limit > 512:  # steps of 512-1024 tokens (~3.4 tokens a word here)
            cases += [("short prompt", 200), ("short prompt", 280), ("over the base", 200), ("over the base", 280)]

        def medians(measure: Callable[..., float], *inputs: Any) -> str:
            """``measure(*inputs)`` under each variant, ``--repeats`` times in alternating order: a median per variant."""
            times: dict[str, list[float]] = {name: [] for name in variants}
            for rep in range(args.repeats):
                for name in list(variants) if rep % 2 == 0 else list(reversed(variants)):
                    engine.runner.piecewise = variants[name]
                    times[name].append(measure(*inputs))
            return " ".join(f"{statistics.median(times[name]):20.1f}" for name in variants)

        def text_step(before: str, extra: int) -> float:
            return first_token(before + words(extra))

        def image_step(width: int, height: int) -> float:
            pixels = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, (height, width, 3), dtype=np.uint8)
            return first_token(words(8), Image.fromarray(pixels))

        for case, extra in cases:
            new = len(tokenizer(words(extra))["input_ids"])
            print(f"{case:16} {new:10d} " + medians(text_step, base + " " if case == "over the base" else "", extra))
        # A small new image and a few words: the ViT runs every time, then one LM step (with Qwen3-VL's DeepStack
        # features, the pieces' second set).
        for width, height in ((448, 448), (640, 480)):
            print(f"{f'image {width}x{height}':16} {'':>10} " + medians(image_step, width, height))

        decode = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

        def text_load() -> tuple[float, int]:
            prompts = [words(60) for _ in range(args.load_requests)]
            torch.cuda.synchronize()
            started, sent, done, steps = time.perf_counter(), 0, 0, 0
            while done < len(prompts):
                if sent < len(prompts) and sent - done < args.running:
                    engine.add_request([{"role": "user", "content": [{"type": "text", "text": prompts[sent]}]}], decode)
                    sent += 1
                done += len(engine.step())
                steps += 1
            torch.cuda.synchronize()
            return time.perf_counter() - started, steps

        print(f"\ntext load: {args.load_requests} requests of ~60 words, 64 tokens out, up to {args.running} running")
        print(f"{'variant':18} {'req/s':>7} {'steps':>6}")
        for name in [*variants, *reversed(variants)]:
            engine.runner.piecewise = variants[name]
            seconds, steps = text_load()
            print(f"{name:18} {args.load_requests / seconds:7.1f} {steps:6d}", flush=True)


if __name__ == "__main__":
    main()
