"""Gemma 4's vision tower per call: host time, GPU time and wall time, per way of running its encoder layers.

    python -m benchmarks.engine.gemma4_vit_bench [--images 1,8] [--budgets 280,1120] [--profile]

The tower of the published Gemma 4 configs (``benchmarks/checkpoints.py`` GEMMA4_VISION: 27 layers of width 1152,
clipped linears) in bf16 with dummy weights, 1080p images at the given soft-token budgets. Variants, all in one
process on the same weights:
- ``eager``: every op from Python (the CPU reference path);
- ``fused ops``: the layers' own forward with their norms, rotary and GELU each one compiled kernel;
- ``layer pieces``: each layer as two compiled pieces around attention (vision_fused.py);
- ``pieces + graphs``: the same, a call of at most layers/vit_graphs.py's MAX_PATCHES rows replayed from a CUDA graph
  once its grids recur (what serving runs; larger calls stay as ``layer pieces``).

``host`` is the time the call takes to return without a sync (the Python dispatch of every kernel), ``gpu`` the CUDA
events' time between the call's first and last kernel, ``wall`` the call plus a synchronize: what a step waits for.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from workers.engine.kernels import fused
from workers.engine.layers.vit_graphs import ViTGraphs
from workers.engine.models.gemma4 import vision
from workers.engine.models.gemma4.vision import Gemma4VisionTower, VisionSpec, build_vision
from workers.engine.models.loader import fill_dummy_weights

VARIANTS = ("eager", "fused ops", "layer pieces", "pieces + graphs")


def grid_1080p(spec: VisionSpec, budget: int) -> tuple[int, int, int]:
    k, patch = spec.pooling_kernel_size, spec.patch_size
    h, w = get_aspect_ratio_preserving_size(
        height=1080, width=1920, patch_size=patch, max_patches=budget * k * k, pooling_kernel_size=k
    )
    return 1, h // patch, w // patch


def set_variant(tower: Gemma4VisionTower, variant: str) -> None:
    fused.enable(tower, variant != "eager")
    vision.LAYER_PIECES = variant in ("layer pieces", "pieces + graphs")
    tower.graphs = ViTGraphs()  # no graph of another variant's kernels
    tower.graphs.on = variant == "pieces + graphs"


def time_call(tower: Gemma4VisionTower, pixels: torch.Tensor, grids: list[tuple[int, int, int]], reps: int) -> dict[str, float]:
    host, gpu, wall = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        tower(pixels, grids)
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
        gpu.append(start.elapsed_time(end))
    return {"host_ms": statistics.median(host), "gpu_ms": statistics.median(gpu), "wall_ms": statistics.median(wall)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--images", default="1,8", help="images per call, comma list")
    ap.add_argument("--budgets", default="280,1120", help="soft-token budgets, comma list")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="the top host ops of one image's call per variant")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = shaped_checkpoint(Path(tmp) / "ckpt", "gemma4-26b-a4b", layers=1)
        spec = VisionSpec.from_hf_config(json.loads((ckpt / "config.json").read_text()))
    tower = build_vision(spec, dtype=torch.bfloat16, device=dev)
    fill_dummy_weights(tower, seed=0)
    calls = []
    for budget in (int(b) for b in args.budgets.split(",")):
        grid = grid_1080p(spec, budget)
        for count in (int(c) for c in args.images.split(",")):
            pixels = torch.rand(count * grid[1] * grid[2], spec.patch_dim, device=dev, dtype=torch.bfloat16)
            calls.append((f"{count} x 1080p at {budget} ({grid[1]} x {grid[2]} patches)", pixels, [grid] * count))
    rows: list[dict[str, object]] = []
    with torch.inference_mode():
        for variant in args.variants.split(","):
            set_variant(tower, variant)
            for _ in range(2):  # compile (static, then symbolic row counts) as the start-up warm-up does
                for _, pixels, grids in calls:
                    tower(pixels, grids)
            for what, pixels, grids in calls:
                rows.append({"variant": variant, "call": what, **time_call(tower, pixels, grids, args.reps)})
            if args.profile:
                _, pixels, grids = calls[0]
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    tower(pixels, grids)
                    torch.cuda.synchronize()
                print(f"\n{variant}: top host ops of {calls[0][0]}")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    card = torch.cuda.get_device_name()
    print(f"\n{card}, torch {torch.__version__}: Gemma 4 vision tower ({spec.num_hidden_layers} layers, width "
          f"{spec.hidden_size}, clipped linears {spec.use_clipped_linears}), bf16, median of {args.reps}")
    print("| call | variant | host ms | GPU ms | wall ms |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['call']} | {r['variant']} | {r['host_ms']:.2f} | {r['gpu_ms']:.2f} | {r['wall_ms']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"card": card, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
