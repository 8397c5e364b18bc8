"""Engine benchmark: one request with N large images, per-image cache vs the baseline mode.

Prints a table (TTFT, peak GPU memory, ViT calls and images encoded per step) and writes JSON.

    python -m benchmarks.engine.engine_bench --shape 7b --device cuda --images 8 --resolution 1080p
    python -m benchmarks.engine.engine_bench --shape demo --device cpu --images 8 --max-pixels 12845056
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
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

RESOLUTIONS = {"720p": (1280, 720), "1080p": (1920, 1080), "2k": (2560, 1440)}


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def messages_with(images: list[Image.Image], text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def release(device: str) -> None:
    """After an engine is dropped: its memory back before the next variant's engine starts."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_to_first_token(
    engine: Engine, messages: list[dict[str, Any]], sampling: SamplingParams, device: str
) -> tuple[str, list[Any], float, float]:
    """Add one request and step until it finishes: (rid, finished outputs, preprocess s, TTFT s)."""
    t0 = time.perf_counter()
    rid = engine.add_request(messages, sampling)
    t_pre = time.perf_counter() - t0
    ttft: float | None = None
    while True:
        finished = engine.step()
        out = engine.peek(rid)
        if ttft is None and (finished or (out is not None and out.token_ids)):
            sync(device)
            ttft = time.perf_counter() - t0
        if finished:
            assert ttft is not None
            return rid, finished, t_pre, ttft


def run_mode(model_dir: Path, args: argparse.Namespace, mode: str, images: list[Image.Image]) -> dict[str, Any]:
    cfg = EngineConfig(
        model=str(model_dir),
        device=args.device,
        dtype=args.dtype,
        load_format="dummy" if args.shape != "demo" else "auto",
        chunk_size=args.chunk_size,
        kv_cache_mb=args.kv_cache_mb,
        max_model_len=args.max_model_len,
        mm_cache_mode=mode,  # type: ignore[arg-type]
        mm_cache_mb=args.mm_cache_mb,
    )
    engine = Engine(cfg)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # Warm up kernels and allocator on a different small image, so the measured request misses the cache.
    engine.generate([messages_with([noise_image(448, 448, seed=999)], "warm up")], greedy)
    encoded_before = engine.stats()["images_encoded"]
    steps_before = len(engine.step_log)
    sync(args.device)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated() if args.device.startswith("cuda") else 0
    prof = None
    if args.profile and mode == "image":
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        prof.__enter__()
    t0 = time.perf_counter()
    rid, finished, t_pre, ttft = run_to_first_token(engine, messages_with(images, "Summarise these pages."), greedy,
                                                    args.device)
    sync(args.device)
    total = time.perf_counter() - t0
    if prof is not None:
        prof.__exit__(None, None, None)
        sort = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=30))
    peak = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else 0
    prefill_steps = engine.step_log[steps_before:]
    result = {
        "mode": mode,
        "prompt_tokens": finished[0].prompt_tokens,
        "preprocess_s": t_pre,
        "ttft_s": ttft,
        "e2e_s": total,
        "peak_gpu_gib": peak / 2**30,
        "peak_over_steady_gib": (peak - base_mem) / 2**30,
        "images_encoded": engine.stats()["images_encoded"] - encoded_before,
        "per_step_images": [n for n, _ in prefill_steps if n],
        "vit_calls": sum(c for _, c in prefill_steps),
        "prefill_steps": sum(1 for _ in prefill_steps) - args.max_tokens + 1,
    }
    del engine
    release(args.device)
    return result


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", choices=["demo", "7b"], default="demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--resolution", choices=sorted(RESOLUTIONS), default="1080p")
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-pixels", type=int, default=None, help="override the image processor's pixel cap")
    ap.add_argument("--max-model-len", type=int, default=65536)
    ap.add_argument("--kv-cache-mb", type=int, default=None)
    ap.add_argument("--mm-cache-mb", type=float, default=4096)
    ap.add_argument("--modes", default="image,request")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table for the per-image mode")
    args = ap.parse_args()
    width, height = RESOLUTIONS[args.resolution]
    images = [noise_image(width, height, seed=i) for i in range(args.images)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = shaped_checkpoint(Path(tmp) / "ckpt", args.shape, args.max_pixels)
        results = [run_mode(model_dir, args, mode, images) for mode in args.modes.split(",")]
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\n{args.images} x {args.resolution}, shape={args.shape}, chunk={args.chunk_size}, device={card}")
    print(f"{'mode':8} {'tokens':>7} {'prep s':>7} {'TTFT s':>7} {'peak GiB':>9} {'+GiB':>6} {'ViT calls':>9} "
          f"{'encoded':>7}  images per encoding step")
    for r in results:
        print(f"{r['mode']:8} {r['prompt_tokens']:>7} {r['preprocess_s']:>7.3f} {r['ttft_s']:>7.3f} "
              f"{r['peak_gpu_gib']:>9.2f} {r['peak_over_steady_gib']:>6.2f} {r['vit_calls']:>9} "
              f"{r['images_encoded']:>7}  {r['per_step_images']}")
    if args.json:
        args.json.write_text(json.dumps({"device": card, "args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
