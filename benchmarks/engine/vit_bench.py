"""ViT and LM-prefill throughput as a share of the card's measured bf16 matmul peak.

FLOPs are counted from the shapes (matmuls as 2*m*n*k, attention as 4*q*k*d per head group), so the share
says how close each forward runs to what the tensor cores did on a large square matmul in the same run.

    python -m benchmarks.engine.vit_bench --images 1,4 --variants eager,fused

``fused`` switches on the compiled elementwise kernels (workers/engine/kernels/fused.py) as the model worker does on
CUDA; ``eager`` is plain PyTorch ops. Both run on the same weights in the same process.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from workers.engine.kernels import fused
from workers.engine.kernels.attention import build_attention_metadata
from workers.engine.models.qwen2_5_vl.lm import TextSpec, load_language_model
from workers.engine.models.qwen2_5_vl.vision import VisionSpec, load_vision


def cuda_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def matmul_peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_ms(lambda: a @ b, 20)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def vit_flops(spec: VisionSpec, grid: tuple[int, int, int]) -> float:
    t, h, w = grid
    n = t * h * w
    d, i = spec.hidden_size, spec.intermediate_size
    window = (spec.window_size // spec.patch_size) ** 2  # patches per full window
    per_block_linear = 2 * n * (4 * d * d + 3 * d * i)
    full = len(spec.fullatt_block_indexes)
    attn = 4 * n * d * (full * (h * w) + (spec.depth - full) * min(window, h * w))
    patch_in = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2
    merge = spec.spatial_merge_size**2
    merger = 2 * (n // merge) * (d * merge) * (d * merge + spec.out_hidden_size)
    return float(spec.depth * per_block_linear + attn + 2 * n * patch_in * d + merger)


def lm_prefill_flops(spec: TextSpec, tokens: int) -> float:
    d, f = spec.hidden_size, spec.intermediate_size
    kv = spec.num_key_value_heads * spec.head_dim
    q = spec.num_attention_heads * spec.head_dim
    linear = 2 * tokens * (d * q + 2 * d * kv + q * d + 3 * d * f)
    attn = 2 * tokens * tokens * q  # causal: half of 4*T*T*q
    return float(spec.num_hidden_layers * (linear + attn))  # hidden states only: no LM head in this forward


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--images", default="1,4")
    ap.add_argument("--prefill-tokens", default="1024,4096")
    ap.add_argument("--variants", default="eager,fused", help="comma list of eager, fused")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    peak = matmul_peak_tflops()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = shaped_checkpoint(Path(tmp) / "ckpt", "7b")
        cfg = json.loads((ckpt / "config.json").read_text())
        vspec, tspec = VisionSpec.from_hf_config(cfg), TextSpec.from_hf_config(cfg)
        vit = load_vision(ckpt, vspec, dtype=torch.bfloat16, device=dev, load_format="dummy")
        grid = (1, 78, 138)  # 1080p after the processor: 1092 x 1932 pixels, 10,764 patches
        patch_dim = vspec.in_channels * vspec.temporal_patch_size * vspec.patch_size**2
        variants = args.variants.split(",")
        with torch.inference_mode():
            for variant in variants:
                fused.enable(vit, variant == "fused")
                for count in (int(x) for x in args.images.split(",")):
                    pixels = torch.randn(count * grid[1] * grid[2], patch_dim, device=dev, dtype=torch.bfloat16)
                    for _ in range(9):  # a recurring resolution: past the cuDNN threshold (vision_attention)
                        vit(pixels, [grid] * count)
                    ms = cuda_ms(partial(vit, pixels, [grid] * count), 5)
                    flops = count * vit_flops(vspec, grid)
                    rows.append({"what": f"ViT {count} x 1080p, {variant}", "ms": ms, "tflop": flops / 1e12,
                                 "tflops": flops / (ms * 1e-3) / 1e12})
            vit.cpu()  # make room for the LM
            torch.cuda.empty_cache()
            lm = load_language_model(ckpt, tspec, dtype=torch.bfloat16, device=dev, load_format="dummy")
            block = 16
            for tokens in (int(x) for x in args.prefill_tokens.split(",")):
                blocks = -(-tokens // block)
                kv = [torch.zeros(lm.kv_cache_shape(blocks, block), dtype=torch.bfloat16, device=dev)
                      for _ in range(tspec.num_hidden_layers)]
                meta = build_attention_metadata([tokens], [tokens], [list(range(blocks))], block, dev)
                embeds = torch.randn(tokens, tspec.hidden_size, device=dev, dtype=torch.bfloat16)
                pos = torch.arange(tokens, device=dev).expand(3, -1)
                for variant in variants:
                    fused.enable(lm, variant == "fused")
                    ms = cuda_ms(partial(lm, embeds, pos, kv, meta), 5)
                    flops = lm_prefill_flops(tspec, tokens)
                    rows.append({"what": f"LM prefill {tokens} tokens, {variant}", "ms": ms,
                                 "tflop": flops / 1e12, "tflops": flops / (ms * 1e-3) / 1e12})
                del kv
    card = torch.cuda.get_device_name()
    print(f"\n{card}: bf16 matmul 8192^3 = {peak:.0f} TFLOP/s (measured in this run)")
    print(f"{'what':36} {'ms':>8} {'TFLOP':>7} {'TFLOP/s':>8} {'of peak':>8}")
    for r in rows:
        share = float(r["tflops"]) / peak  # type: ignore[arg-type]
        print(f"{r['what']:36} {r['ms']:>8.2f} {r['tflop']:>7.2f} {r['tflops']:>8.0f} {share:>8.0%}")
    if args.json:
        args.json.write_text(json.dumps({"card": card, "peak_tflops": peak, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
