"""FP8 serving against bf16 on one GPU, no download: the same published shape written as a bf16 and as a block-FP8
checkpoint (Qwen's ``-FP8`` quantization_config; benchmarks/checkpoints.py), each served with dummy weights (the
loader quantizes them in the checkpoint's layout) in turn, driven by the bench client. Prints one table.

    python -m benchmarks.serving.fp8_bench --shape qwen3-8b
    python -m benchmarks.serving.fp8_bench --shape qwen3-30b-a3b --variants bf16,fp8,fp8-w8a16 --layers 24

Variants (``--variants``): ``bf16`` (the bf16 checkpoint); ``fp8`` (the FP8 checkpoint, ``GLIMPSE_FP8_GEMM=auto``, the
default: w8a16_gemm.py's decode kernel at decode rows, the scaled-FP8 kernels above); ``fp8-no-tma`` (``auto`` with
``GLIMPSE_W8A16_TMA=0``: the decode kernel's weight through per-thread loads instead of TMA on Hopper); ``fp8-w8a16``
(``GLIMPSE_FP8_GEMM=w8a16``: the decode kernel at every row count); ``fp8-torch-quant`` (``auto`` with the block
GEMMs' activations quantized by torch's ops, ``GLIMPSE_TRITON_FP8_QUANT=0``, instead of fp8_act_quant.py's kernel);
``fp8-w8a16-16`` (``auto`` with the decode kernel up to 16 rows, ``GLIMPSE_W8A16_MAX_ROWS=16``, instead of 64);
``fp8-dequant`` (the FP8 checkpoint under the default ``bf16``: dequantized at load, so it should match ``bf16``);
``fp8-dynamic`` (compressed-tensors per-channel FP8, ``auto``); ``bf16-compiled-norms`` and ``fp8-compiled-norms`` (the
LM's RMSNorms through the torch.compile'd add + norm, ``GLIMPSE_TRITON_NORM=0``, instead of split_norm.py's kernel).
Columns: start-up (spawn to /health), (a) one request of 8 x 1080p images, mean TTFT over ``--ttft-requests``
sequential requests after the warm-up; (b) ``--num-prompts`` requests of 1 x 1080p, 128 tokens out, at
``--concurrency``: req/s and mean TPOT; (d) batch-1 text: mean TPOT of ``--text-requests`` sequential text-only
requests of 256 tokens; the language model's weight bytes on the GPU (/admin/stats, rank 0) and the ViT's.
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.args import parser
from benchmarks.checkpoints import keep_layers, shaped_checkpoint
from benchmarks.serving.dp_bench import bench, load_flags, multiturn, serve

# name -> (checkpoint format: None for bf16, the server's environment)
VARIANTS: dict[str, tuple[str | None, dict[str, str]]] = {
    "bf16": (None, {}),
    "fp8": ("fp8-block", {"GLIMPSE_FP8_GEMM": "auto"}),
    "fp8-no-tma": ("fp8-block", {"GLIMPSE_FP8_GEMM": "auto", "GLIMPSE_W8A16_TMA": "0"}),
    "fp8-torch-quant": ("fp8-block", {"GLIMPSE_FP8_GEMM": "auto", "GLIMPSE_TRITON_FP8_QUANT": "0"}),
    "fp8-w8a16-16": ("fp8-block", {"GLIMPSE_FP8_GEMM": "auto", "GLIMPSE_W8A16_MAX_ROWS": "16"}),
    "fp8-w8a16": ("fp8-block", {"GLIMPSE_FP8_GEMM": "w8a16"}),
    "fp8-dequant": ("fp8-block", {"GLIMPSE_FP8_GEMM": "bf16"}),
    "fp8-bf16-experts": ("fp8-block", {"GLIMPSE_FP8_GEMM": "auto", "GLIMPSE_FP8_BLOCK_EXPERTS": "bf16"}),
    "fp8-bf16-attn": ("fp8-block", {"GLIMPSE_FP8_GEMM": "auto", "GLIMPSE_FP8_KEEP_DTYPE": "self_attn"}),
    "fp8-dynamic": ("fp8-dynamic", {"GLIMPSE_FP8_GEMM": "auto"}),
    "bf16-compiled-norms": (None, {"GLIMPSE_TRITON_NORM": "0"}),
    "fp8-compiled-norms": ("fp8-block", {"GLIMPSE_FP8_GEMM": "auto", "GLIMPSE_TRITON_NORM": "0"}),
}


def mean(result: dict[str, Any], key: str) -> float | None:
    value = (result.get(key) or {}).get("mean")
    return None if value is None else float(value)


def weights(base: str) -> dict[str, float]:
    """GiB of the model worker's weights (rank 0): the whole model and the vision tower's part."""
    workers = httpx.get(base + "/admin/stats", timeout=10).json().get("model_workers") or [{}]
    return {"weights_gib": workers[0].get("weight_bytes", 0) / 2**30,
            "vision_gib": workers[0].get("vision_weight_bytes", 0) / 2**30}  # fmt: skip


def run_variant(model: Path, name: str, env: dict[str, str], tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Serve ``model`` with ``env``, warm it up (8 requests), then (a), (b), (d) and the stats; stop it."""
    flags = shlex.split(args.serve_flags)
    began = time.perf_counter()
    proc, base = serve(model, flags, tmp / f"serve-{name}.log", env=env)
    row: dict[str, Any] = {"variant": name, "startup_s": time.perf_counter() - began, **env}
    try:
        bench(base, argparse.Namespace(num_prompts=8, concurrency=8), tmp / f"warm-{name}", seed=100)
        one = argparse.Namespace(num_prompts=args.ttft_requests, concurrency=1)
        row["a_ttft_ms"] = mean(bench(base, one, tmp / f"a-{name}", seed=1, images=8, output_len=16), "ttft_ms")
        if args.num_prompts:
            b = bench(base, args, tmp / f"b-{name}", seed=2, images=1, output_len=128)
            row["b_req_s"], row["b_tpot_ms"] = b.get("request_throughput"), mean(b, "tpot_ms")
        text = argparse.Namespace(num_prompts=args.text_requests, concurrency=1)
        row["d_tpot_ms"] = mean(bench(base, text, tmp / f"d-{name}", seed=3, images=0, output_len=256), "tpot_ms")
        if args.multiturn:
            row["multiturn"] = multiturn(base, args.multiturn, 8, tmp / f"mt-{name}")
        row.update(weights(base))
    finally:
        proc.terminate()
        proc.wait(60)
    return row


def cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]]) -> None:
    print("| variant | start-up s | (a) 8x1080p TTFT ms | (b) req/s | (b) TPOT ms | (d) batch-1 TPOT ms "
          "| weights GiB | of which ViT | (b) / bf16 | (d) bf16 / this |")
    print("|---" * 10 + "|")
    base = next((r for r in rows if r["variant"] == "bf16"), None)
    for r in rows:
        gain_b = r.get("b_req_s") / base["b_req_s"] if base and r.get("b_req_s") and base.get("b_req_s") else None
        gain_d = base["d_tpot_ms"] / r["d_tpot_ms"] if base and r.get("d_tpot_ms") and base.get("d_tpot_ms") else None
        print(f"| {r['variant']} | {r['startup_s']:.1f} | {cell(r.get('a_ttft_ms'), '.0f')} "
              f"| {cell(r.get('b_req_s'), '.2f')} | {cell(r.get('b_tpot_ms'), '.1f')} | {cell(r.get('d_tpot_ms'), '.2f')} "
              f"| {cell(r.get('weights_gib'), '.2f')} | {cell(r.get('vision_gib'), '.2f')} "
              f"| {cell(gain_b, '.2f')} | {cell(gain_d, '.2f')} |")  # fmt: skip


def main() -> None:
    ap = parser(__doc__)
    load_flags(ap, "qwen3-8b", 64)
    ap.add_argument("--variants", default="bf16,fp8", help="comma-separated: " + ", ".join(VARIANTS))
    ap.add_argument("--layers", type=int, default=0, help="decoder layers kept (0: all)")
    ap.add_argument("--ttft-requests", type=int, default=3, help="(a): sequential 8 x 1080p requests")
    ap.add_argument("--text-requests", type=int, default=3, help="(d): sequential text requests of 256 tokens")
    ap.add_argument("--serve-flags", default="", help="more `glimpse serve` flags for every variant")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    rows = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        checkpoints: dict[str | None, Path] = {}
        for variant in names:
            fmt, env = VARIANTS[variant]
            if fmt not in checkpoints:
                dest = tmp / f"ckpt-{fmt or 'bf16'}"
                if args.checkpoints:  # a folder holding SHAPE: its config (and processor) with the format's config
                    checkpoints[fmt] = shaped_from(args.checkpoints / args.shape, dest, fmt, args.layers)
                else:
                    checkpoints[fmt] = shaped_checkpoint(dest, args.shape, quantize=fmt, layers=args.layers)
            rows.append(run_variant(checkpoints[fmt], variant, env, tmp, args))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.shape} ({args.layers or 'all'} layers), dummy weights; (b): {args.num_prompts} requests of "
          f"1 x 1080p, 128 out, concurrency {args.concurrency}")
    table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def shaped_from(src: Path, dest: Path, fmt: str | None, layers: int) -> Path:
    """``src``'s files linked into ``dest`` but config.json, rewritten with ``fmt``'s quantization_config and
    ``layers`` (the servers load dummy weights, so only the config and the processor files matter)."""
    from workers.engine.models.demo_quantize import quantization_config

    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dest / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if fmt is not None:
        cfg["quantization_config"] = quantization_config(fmt, [])
    keep_layers(cfg, layers)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest


if __name__ == "__main__":
    main()
