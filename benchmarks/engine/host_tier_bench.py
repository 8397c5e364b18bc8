"""Host tiers benchmark: a long multi-turn chat that resends its images, against GPU caches too small to keep them.

Each round adds new images and a question to each of ``--chats`` chats (served in turn, one request at a time) and
resends everything before it (the turns and the images), as chat clients do. Three engines run the same chats, one
after the other:

- ``all in GPU``: caches large enough to keep the whole chat (the reference);
- ``small GPU``: the KV pool and the embedding cache sized by ``--small-kv-blocks`` / ``--small-mm-cache-mb``, so
  late rounds recompute evicted turns and re-encode evicted images;
- ``small GPU + host``: the same, with the host tiers under both caches (``--kv-host-cache-mb``,
  ``--mm-host-cache-mb``): evicted blocks and embeddings are copied back instead.

Prints a line per request as it ends and each engine's row when it is done (a run cut short keeps what it measured),
then the table: one row per engine (TTFT of the first and the last rounds, averaged over the chats; the late rounds'
prompt preparation; the late rounds against the reference, with and without it; the prompt tokens computed, the
images encoded, the host tiers' loads); writes JSON with every round. The preparation is reported apart because this
offline engine prepares every image of the prompt each round (30-40 ms per 1080p image on an H200 host), which grows
with the chat and is the same for every engine; the server's tokenizers skip it for an image they hold already.

    python -m benchmarks.engine.host_tier_bench --shape demo --device cpu --chats 3 --rounds 4 --resolution 720p
    python -m benchmarks.engine.host_tier_bench --shape qwen3-8b --device cuda --chats 2 --rounds 32 \\
        --images-per-round 1 --small-kv-blocks 4600 --small-mm-cache-mb 1024 --kv-host-cache-mb 32768 \\
        --mm-host-cache-mb 8192

The small KV pool must hold one chat's last prompt (the engine refuses a prompt larger than its whole pool): a
1080p image is about 2,000 tokens on the Qwen3-VL shapes, so ``rounds x images-per-round x 130`` blocks and a few
hundred more for the turns. On an H200 the example takes about 5 minutes, most of it the small-GPU engine, which
recomputes much of each late prompt.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from statistics import mean
from typing import Any

import torch
from PIL import Image

from benchmarks.args import parser
from benchmarks.checkpoints import SHAPES, shaped_checkpoint
from benchmarks.engine.engine_bench import RESOLUTIONS, noise_image, release, run_to_first_token, sync
from ipc.prompts import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine


def chat_round(history: list[dict[str, Any]], images: list[Image.Image], question: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images]
    return [*history, {"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def run_chat(cfg: EngineConfig, args: argparse.Namespace, label: str) -> dict[str, Any]:
    engine = Engine(cfg)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    width, height = RESOLUTIONS[args.resolution]
    engine.generate([chat_round([], [noise_image(448, 448, seed=999)], "warm up")], greedy)
    start = engine.stats()
    histories: list[list[dict[str, Any]]] = [[] for _ in range(args.chats)]
    ttfts, preps, prompts = [], [], []
    for r in range(args.rounds):  # round r of every chat in turn: each chat's blocks and images compete
        round_ttft, round_prep = [], []
        for c, history in enumerate(histories):
            seed = 10_000 * c + 100 * r
            images = [noise_image(width, height, seed=seed + i) for i in range(args.images_per_round)]
            messages = chat_round(history, images, f"Round {r + 1}: what changed since the last pages?")
            _, finished, prep, ttft = run_to_first_token(engine, messages, greedy, args.device)
            out = finished[0]
            round_ttft.append(ttft * 1e3)
            round_prep.append(prep * 1e3)
            prompts.append(out.prompt_tokens)
            # One line per request as it ends: a run cut short by a time limit still shows how far it got.
            print(f"  {label} round {r + 1} chat {c}: {out.prompt_tokens:,} prompt tokens, TTFT {ttft * 1e3:.1f} ms "
                  f"(prompt preparation {prep * 1e3:.1f})", flush=True)
            histories[c] = [*messages, {"role": "assistant", "content": out.text or "noted"}]
        ttfts.append(mean(round_ttft))
        preps.append(mean(round_prep))
    sync(args.device)
    end = engine.stats()
    kv_host, mm_host = end["kv_host_cache"], end["mm_host_cache"]
    result = {
        "ttft_ms": ttfts,
        "prep_ms": preps,
        "prompt_tokens": prompts,
        "prompt_tokens_computed": end["prompt_tokens_computed"] - start["prompt_tokens_computed"],
        "images_encoded": end["images_encoded"] - start["images_encoded"],
        "kv_host_loaded_blocks": kv_host.get("loaded_blocks", 0) - start["kv_host_cache"].get("loaded_blocks", 0),
        "mm_host_reloads": mm_host.get("worker_reloads", 0) - start["mm_host_cache"].get("worker_reloads", 0),
    }
    del engine
    release(args.device)
    return result


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", choices=["demo", *sorted(SHAPES)], default="demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--chats", type=int, default=4, help="chats served in turn, round by round")
    ap.add_argument("--images-per-round", type=int, default=2)
    ap.add_argument("--resolution", choices=sorted(RESOLUTIONS), default="1080p")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=262144)
    ap.add_argument("--big-kv-blocks", type=int, default=None, help="the reference's KV pool (default: the budget's)")
    ap.add_argument("--big-mm-cache-mb", type=float, default=16384)
    ap.add_argument("--small-kv-blocks", type=int, default=96)
    ap.add_argument("--small-mm-cache-mb", type=float, default=16)
    ap.add_argument("--kv-host-cache-mb", type=float, default=512)
    ap.add_argument("--mm-host-cache-mb", type=float, default=512)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        run(shaped_checkpoint(Path(tmp) / args.shape, args.shape), args)


def run(model_dir: Path, args: argparse.Namespace) -> None:
    base: dict[str, Any] = {
        "model": str(model_dir), "device": args.device, "dtype": args.dtype, "max_model_len": args.max_model_len,
        "load_format": "auto" if args.shape == "demo" else "dummy", "block_size": 16,
    }
    engines = {
        "all in GPU": EngineConfig(**base, num_kv_blocks=args.big_kv_blocks, mm_cache_mb=args.big_mm_cache_mb),
        "small GPU": EngineConfig(**base, num_kv_blocks=args.small_kv_blocks, mm_cache_mb=args.small_mm_cache_mb),
        "small GPU + host": EngineConfig(**base, num_kv_blocks=args.small_kv_blocks, mm_cache_mb=args.small_mm_cache_mb,
                                         kv_host_cache_mb=args.kv_host_cache_mb,
                                         mm_host_cache_mb=args.mm_host_cache_mb),
    }
    late = max(1, args.rounds // 4)  # the last quarter of the rounds
    head = (f"{args.shape}, {args.device}, {args.chats} chats, {args.rounds} rounds x {args.images_per_round} x "
            f"{args.resolution}, late = the last {late} rounds\n"
            "| engine | TTFT round 1, ms | late TTFT mean, ms | of which prompt preparation | late / all in GPU "
            "| late without preparation / all in GPU | prompt tokens computed | images encoded | KV blocks from host "
            "| embeddings from host |\n|---|---|---|---|---|---|---|---|---|---|")
    results: dict[str, dict[str, Any]] = {}
    rows = []
    for name, cfg in engines.items():  # each engine's row as soon as it is done, then the table
        r = results[name] = run_chat(cfg, args, name)
        late_ttft, late_prep = mean(r["ttft_ms"][-late:]), mean(r["prep_ms"][-late:])
        ref = results["all in GPU"]
        ref_ttft, ref_prep = mean(ref["ttft_ms"][-late:]), mean(ref["prep_ms"][-late:])
        rows.append(f"| {name} | {r['ttft_ms'][0]:.1f} | {late_ttft:.1f} | {late_prep:.1f} | "
                    f"{late_ttft / ref_ttft:.2f} | {(late_ttft - late_prep) / (ref_ttft - ref_prep):.2f} | "
                    f"{r['prompt_tokens_computed']:,} | {r['images_encoded']} | {r['kv_host_loaded_blocks']} | "
                    f"{r['mm_host_reloads']} |")
        print(rows[-1], flush=True)
    print("\n" + head + "\n" + "\n".join(rows))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
