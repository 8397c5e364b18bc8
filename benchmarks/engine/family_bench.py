"""Model families side by side at real shapes (dummy bf16 weights): ViT time and share of the measured bf16 peak
for one 1080p image, TTFT and peak GPU memory of one request with 8 x 1080p, embedding-cache bytes per 1080p
image (main + DeepStack), and decode tok/s at batch 1 and 32. Prints one table and writes JSON.

    python -m benchmarks.engine.family_bench --shapes 7b,qwen3-8b,qwen3-30b-a3b
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.args import engine_flags, parser
from benchmarks.checkpoints import shaped_checkpoint
from benchmarks.engine.engine_bench import RESOLUTIONS, messages_with, noise_image, run_to_first_token
from benchmarks.engine.vit_bench import cuda_ms, matmul_peak_tflops, vit_flops
from ipc.prompts import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.models.model_spec import ModelSpec
from workers.engine.offline import Engine


def qwen3_vit_flops(spec: Any, grid: tuple[int, int, int]) -> float:
    """Qwen3-VL ViT: full attention within each frame, the main merger and one merger per DeepStack level."""
    t, h, w = grid
    n = t * h * w
    d, i = spec.hidden_size, spec.intermediate_size
    linear = spec.depth * 2 * n * (4 * d * d + 2 * d * i)
    attn = spec.depth * 4 * n * d * (h * w)
    patch_in = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2
    merge = spec.spatial_merge_size**2
    merger = 2 * (n // merge) * (d * merge) * (d * merge + spec.out_hidden_size)
    return float(linear + attn + 2 * n * patch_in * d + merger * (1 + len(spec.deepstack_visual_indexes)))


def engine_for(model_dir: Path, args: argparse.Namespace) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir),
            device="cuda",
            dtype="bfloat16",
            load_format="dummy",
            chunk_size=args.chunk_size,
            kv_cache_mb=args.kv_cache_mb,
            max_model_len=65536,
            mm_cache_mb=args.mm_cache_mb,
        )
    )


def vit_row(engine: Engine, spec: ModelSpec, peak: float) -> dict[str, float]:
    width, height = RESOLUTIONS["1080p"]
    image = engine.processor.process_image(noise_image(width, height, seed=7))
    pixels = image.pixel_values.to("cuda", torch.bfloat16)
    model = engine.runner.model
    with torch.inference_mode():
        # Steady state: past the 8 images after which a recurring frame length gets its cuDNN plan (vision_attention).
        for _ in range(10):
            model.encode(pixels, [image.grid])
        ms = cuda_ms(lambda: model.encode(pixels, [image.grid]), 10)
    flops = (qwen3_vit_flops if spec.family == "qwen3_vl" else vit_flops)(spec.vision, image.grid)
    return {
        "vit_ms": ms,
        "vit_share": flops / (ms * 1e-3) / 1e12 / peak,
        "tokens_1080p": image.num_tokens,
        "embed_mib_1080p": image.num_tokens * spec.embedding_bytes_per_token(torch.bfloat16) / 2**20,
    }


def ttft_row(engine: Engine, images: int) -> dict[str, float]:
    width, height = RESOLUTIONS["1080p"]
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate([messages_with([noise_image(448, 448, seed=999)], "warm up")], greedy)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    msgs = messages_with([noise_image(width, height, seed=i) for i in range(images)], "Summarise these pages.")
    _, finished, _, ttft = run_to_first_token(engine, msgs, greedy, "cuda")
    return {"ttft_8x1080p_s": ttft, "prompt_tokens": finished[0].prompt_tokens,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def decode_tok_s(engine: Engine, batch: int, new_tokens: int) -> float:
    """Decode throughput once every sequence has its first token (prefill excluded)."""
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request([{"role": "user", "content": f"Story number {i}, please."}], sampling)
            for i in range(batch)]
    while any(not ((o := engine.peek(r)) is not None and o.token_ids) for r in rids):
        engine.step()
    torch.cuda.synchronize()
    done_before = {r: len(o.token_ids) for r in rids if (o := engine.peek(r)) is not None}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return sum(new_tokens - n for n in done_before.values()) / elapsed


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shapes", default="7b,qwen3-8b,qwen3-30b-a3b")
    engine_flags(ap)
    ap.add_argument("--mm-cache-mb", type=float, default=2048)
    ap.add_argument("--checkpoints", type=Path, default=None,
                    help="folder of SHAPE/ checkpoint dirs written beforehand (benchmarks.checkpoints), e.g. on a "
                    "machine whose transformers cannot write the demo models")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    peak = matmul_peak_tflops()
    card = torch.cuda.get_device_name()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            model_dir = args.checkpoints / shape if args.checkpoints else shaped_checkpoint(Path(tmp) / shape, shape)
            started = time.perf_counter()
            engine = engine_for(model_dir, args)
            spec = engine.info
            row: dict[str, Any] = {"shape": shape, "family": spec.family, "start_s": time.perf_counter() - started}
            row |= vit_row(engine, spec, peak)
            row |= ttft_row(engine, args.images)
            for batch in (1, 32):
                decode_tok_s(engine, batch, 8)  # captures this batch's CUDA graphs outside the timed run
                row[f"decode_b{batch}_tok_s"] = decode_tok_s(engine, batch, args.decode_tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\n{card}: bf16 matmul 8192^3 = {peak:.0f} TFLOP/s (measured in this run); dummy weights, bf16, "
          f"chunk {args.chunk_size}")
    print(f"{'shape':14} {'ViT ms':>7} {'of peak':>7} {'tok/img':>7} {'MiB/img':>7} {'TTFT s':>7} {'peak GiB':>8} "
          f"{'dec b1':>7} {'dec b32':>8}")
    for r in rows:
        print(f"{r['shape']:14} {r['vit_ms']:>7.1f} {r['vit_share']:>7.0%} {r['tokens_1080p']:>7} "
              f"{r['embed_mib_1080p']:>7.1f} {r['ttft_8x1080p_s']:>7.3f} {r['peak_gib']:>8.2f} "
              f"{r['decode_b1_tok_s']:>7.0f} {r['decode_b32_tok_s']:>8.0f}")
    if args.json:
        args.json.write_text(json.dumps({"card": card, "peak_tflops": peak, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
