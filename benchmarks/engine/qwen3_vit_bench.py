"""The Qwen3-VL / Qwen3.5 vision tower (workers/engine/models/qwen3_vl/vision.py) per call on CUDA, 1080p images
(1088 x 1920: 8,160 patches each), dummy weights: eager, fused as served (fused.enable), fused with the MLP's GELU
as its own kernel instead of in the first projection's cuBLASLt epilogue (``vision.GELU_EPILOGUE``), and on FA4 fused
with the heads padded to 80 by copies after the rotary instead of in its pass (``vision_attention.PADDED_ROTARY``).
The variants run in one process, interleaved over ``--rounds``; each row is the median round, with the largest
relative difference of its output from the eager one's.

    python -m benchmarks.engine.qwen3_vit_bench --images 1,2
    python -m benchmarks.engine.qwen3_vit_bench --images 2 --attention fa4   # full blocks on FA4's packed call

The tower's shape is the published one (27 blocks of width 1152, 16 heads of 72, 4,304-wide MLP); ``--deepstack``
adds Qwen3-VL-8B's three DeepStack mergers (the Qwen3.5 tower has none).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from benchmarks.args import parser
from benchmarks.checkpoints import QWEN3_VL_VISION
from benchmarks.engine.vit_bench import cuda_ms
from workers.engine.kernels import fa4_attention, fused
from workers.engine.layers import vision_attention
from workers.engine.layers.vision_attention import VisionAttention
from workers.engine.models.qwen3_vl import vision
from workers.engine.models.qwen3_vl.vision import VisionSpec, VisionTower

GRID = (1, 68, 120)  # 1088 x 1920 pixels in 16-pixel patches
VARIANTS: dict[str, tuple[bool, bool, bool]] = {  # name -> (fused kernels on, GELU in the epilogue, padded rotary)
    "eager": (False, False, True),
    "fused, GELU kernel": (True, False, True),
    "fused, heads padded by copies": (True, True, False),  # the same as served off FA4 (no padding there)
    "fused (served)": (True, True, True),
}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--images", default="1,2", help="images per call, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="calls per round")
    ap.add_argument("--attention", choices=("auto", "fa4"), default="auto",
                    help="auto: the tower's own choice (cuDNN frames once hot); fa4: FA4's packed call")  # fmt: skip
    ap.add_argument("--deepstack", action="store_true", help="Qwen3-VL-8B's DeepStack mergers too")
    args = ap.parse_args()
    dev = torch.device("cuda")
    levels = tuple(QWEN3_VL_VISION["deepstack_visual_indexes"]) if args.deepstack else ()  # type: ignore[arg-type]
    cfg = {k: v for k, v in QWEN3_VL_VISION.items() if k != "deepstack_visual_indexes"}
    spec = replace(VisionSpec(**cfg), out_hidden_size=4096, deepstack_visual_indexes=levels)  # type: ignore[arg-type]
    tower = VisionTower.build(spec, dtype=torch.bfloat16, device=dev)
    tower.init_dummy()
    if args.attention == "fa4":
        packed = fa4_attention.vision_kernel("fa4", dev)
        if packed is None:
            raise SystemExit(f"FA4: {fa4_attention.unavailable_reason(dev)}")
        for module in tower.modules():
            if isinstance(module, VisionAttention):
                module.packed = packed
    epilogue = vision.GELU_EPILOGUE
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, attention {args.attention}")
    print("| images | variant | ms a call | vs eager | max rel diff vs eager |\n|---|---|---|---|---|")
    try:
        with torch.inference_mode():
            for count in (int(n) for n in args.images.split(",")):
                pixels = torch.randn(count * GRID[1] * GRID[2], 3 * 2 * 16 * 16, device=dev, dtype=torch.bfloat16)
                outs: dict[str, torch.Tensor] = {}
                times: dict[str, list[float]] = {name: [] for name in VARIANTS}
                for rnd in range(args.rounds + 1):  # round 0 warms up (compiles, cuDNN's plans, FA4's kernels)
                    for name, (on, gelu_epilogue, padded_rotary) in VARIANTS.items():
                        fused.enable(tower, on)
                        vision.GELU_EPILOGUE = gelu_epilogue
                        vision_attention.PADDED_ROTARY = padded_rotary
                        if rnd == 0:
                            for _ in range(10):
                                outs[name] = tower(pixels, [GRID] * count).float()
                        else:
                            times[name].append(cuda_ms(partial(tower, pixels, [GRID] * count), args.reps))
                base = outs["eager"]
                eager_ms = sorted(times["eager"])[len(times["eager"]) // 2]
                for name in VARIANTS:
                    ms = sorted(times[name])[len(times[name]) // 2]
                    diff = ((outs[name] - base).norm() / base.norm()).item()
                    print(f"| {count} | {name} | {ms:.2f} | {eager_ms / ms:.3f}x | {diff:.2e} |")
    finally:
        vision.GELU_EPILOGUE, vision_attention.PADDED_ROTARY = epilogue, True


if __name__ == "__main__":
    main()
