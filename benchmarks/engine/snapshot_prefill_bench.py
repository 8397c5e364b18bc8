"""Prefill of a hybrid (Gated DeltaNet) model with state snapshots inside the step's chunks: the fla wrapper's two
paths side by side in one process, alternating, on fresh text prompts (no prefix hits). ``rounds`` cuts each
sequence at its snapshot points and calls fla's public chunk function per piece; ``states`` runs fla's chunked
pipeline once per layer and reads the snapshots from the per-chunk states it keeps (workers/engine/kernels/
gated_delta_fla.py). Prints TTFT medians per prompt length.

    python -m benchmarks.engine.snapshot_prefill_bench --shape qwen3.5-35b-a3b --layers 20
    python -m benchmarks.engine.snapshot_prefill_bench --shape demo --device cpu --words 100 --reps 1

On the CPU (or without fla) both rows run the torch path: the smoke run checks the script, not the kernels.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from ipc.prompts import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.kernels import gated_delta_fla
from workers.engine.models.demo_writer import ensure_demo_model
from workers.engine.offline import Engine

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
MODES = ("rounds", "states")


def checkpoint(shape: str, layers: int, scratch: Path) -> Path:
    """A config-only checkpoint of ``shape`` cut to ``layers`` decoder layers (0: all), or the demo's."""
    if shape == "demo":
        return ensure_demo_model(family="qwen3_5_moe")
    ck = shaped_checkpoint(scratch / shape, shape)
    if layers:
        cfg = json.loads((ck / "config.json").read_text())
        text = cfg.get("text_config", cfg)
        text["num_hidden_layers"] = layers
        text["layer_types"] = text["layer_types"][:layers]
        (ck / "config.json").write_text(json.dumps(cfg))
    return ck


def prompt(words: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"role": "user", "content": " ".join(rng.choice(WORDS) + str(rng.randint(0, 999)) for _ in range(words))}]


def ttft(engine: Engine, messages: list[dict[str, Any]], device: str) -> tuple[float, int]:
    """Seconds to the one output token of a fresh request, and its prompt tokens."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    engine.add_request(messages, SamplingParams(max_tokens=1, temperature=0.0))
    while not (finished := engine.step()):
        pass
    sync()
    return time.perf_counter() - t0, finished[0].prompt_tokens


def use(mode: str) -> None:
    """``rounds``: the kept-states pipeline off for this process; ``states``: tried (and probed) on first use."""
    gated_delta_fla._states = False if mode == "rounds" else None


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", default="qwen3.5-35b-a3b", help="a hybrid shape of benchmarks/checkpoints.py, or demo")
    ap.add_argument("--layers", type=int, default=20, help="decoder layers kept (0: all)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--words", default="700,2000,4000", help="prompt lengths in words (~6 tokens each)")
    ap.add_argument("--reps", type=int, default=3, help="timed prompts per length and path (after one warm-up each)")
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=None, help="default: 128 on CUDA, 16 on the CPU")
    ap.add_argument("--snapshot-every", type=int, default=16, help="blocks between snapshots (--state-snapshot-every)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    layers = "all" if args.shape == "demo" or not args.layers else args.layers
    with tempfile.TemporaryDirectory() as scratch:
        ck = checkpoint(args.shape, args.layers, Path(scratch))
        engine = Engine(EngineConfig(
            model=str(ck), device=args.device, dtype="bfloat16" if cuda else "float32",
            load_format="dummy" if args.shape != "demo" else "auto", chunk_size=args.chunk_size,
            kv_cache_mb=16384 if cuda else 256, max_model_len=65536,
            block_size=args.block_size or (128 if cuda else 16), state_snapshot_every=args.snapshot_every,
        ))  # fmt: skip
        rows: list[tuple[int, float, float]] = []
        seed = 0
        for words in (int(w) for w in args.words.split(",")):
            times: dict[str, list[float]] = {m: [] for m in MODES}
            tokens = 0
            for rep in range(args.reps + 1):
                for mode in MODES:
                    use(mode)
                    seed += 1
                    seconds, tokens = ttft(engine, prompt(words, seed), args.device)
                    if rep:  # the first of each is a warm-up (Triton compiles, allocator growth)
                        times[mode].append(seconds * 1e3)
            rows.append((tokens, statistics.median(times["rounds"]), statistics.median(times["states"])))
            print(f"{words} words: {tokens} tokens, " + ", ".join(f"{m} {statistics.median(times[m]):.1f} ms" for m in MODES),
                  flush=True)  # fmt: skip
    fla = "kept-states pipeline in use" if gated_delta_fla._states else "torch path (no fla on this device)"
    print(f"\n{args.shape} ({layers} layers), {args.device}, blocks of {args.block_size or (128 if cuda else 16)}, "
          f"a snapshot every {args.snapshot_every} blocks, chunks of {args.chunk_size}: {fla}")  # fmt: skip
    print("\n| prompt tokens | rounds, ms | kept states, ms |\n|---|---|---|")
    for n, rounds, states in rows:
        print(f"| {n:,} | {rounds:.1f} | {states:.1f} |")


if __name__ == "__main__":
    main()
