"""Encoder workers beside the language model on one host: the same server (dummy weights at a real shape) with and
without `--encoder-workers`, one after another on the same GPUs, driven by the bench client. Prints one table:
requests/s, TTFT, TPOT and inter-token gaps of an image-heavy load, and who ran the ViT.

    python -m benchmarks.serving.encoder_bench --shape qwen3-8b --images-per-request 4 --num-prompts 64
    python -m benchmarks.serving.encoder_bench --variants "plain=;colocated=--encoder-workers 1" --multiturn 16
    python -m benchmarks.serving.encoder_bench --num-prompts 48 --request-rates 0.8,1.4   # Poisson arrivals
    python -m benchmarks.serving.encoder_bench \
        --variants "plain=;shm=--encoder-workers 1;pool=--encoder-workers 1 --encoder-landing-mb 16384"

A variant is ``name=flags`` (flags as on the command line, variants separated by ``;``). On one GPU,
``--encoder-workers 1`` is the colocated mode (the encoder process on the LM's GPU); with more GPUs,
``--encoder-devices`` places encoders on their own.
"""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path
from typing import Any

import httpx

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from benchmarks.serving.dp_bench import load_flags, measure

DEFAULT_VARIANTS = "plain=;colocated=--encoder-workers 1"


def variants(spec: str) -> list[tuple[str, list[str]]]:
    out = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, _, flags = item.partition("=")
        out.append((name.strip(), shlex.split(flags)))
    return out


def vit_counts(base: str) -> dict[str, int]:
    """Images the model workers and the encoder workers encoded so far (server-wide counters)."""
    stats = httpx.get(base + "/admin/stats", timeout=10).json()
    return {"lm_encodes": sum(w["images_encoded"] for w in stats.get("model_workers", [])),
            "encoder_encodes": sum(e["images_encoded"] for e in stats.get("encoder_workers", []))}  # fmt: skip


def row(name: str, result: dict[str, Any]) -> str:
    def ms(key: str, stat: str) -> str:
        value = (result.get(key) or {}).get(stat)
        return "" if value is None else f"{value:.0f}"

    last = result.get("multiturn", {}).get("last_round_ttft_ms")
    return (f"| {name} | {result.get('request_throughput', '')} | {ms('ttft_ms', 'mean')} | {ms('ttft_ms', 'median')} "
            f"| {ms('ttft_ms', 'p90')} | {ms('ttft_ms', 'p99')} | {ms('tpot_ms', 'mean')} | {ms('itl_ms', 'p99')} "
            f"| {'' if last is None else f'{last:.0f}'} | {result['lm_encodes']} | {result['encoder_encodes']} |")  # fmt: skip


def main() -> None:
    ap = parser(__doc__)
    load_flags(ap, "qwen3-8b", 64)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--images-per-request", type=int, default=4)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        model = args.checkpoints / args.shape if args.checkpoints else shaped_checkpoint(tmp / "ckpt", args.shape)
        for i, (label, flags) in enumerate(variants(args.variants)):
            result = measure(model, flags, tmp, str(i), args, seed=1, images=args.images_per_request, stats=vit_counts)
            rows.append({"variant": label, "flags": flags, **result})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.shape}: {args.num_prompts} requests of {args.images_per_request} x 1080p, 128 out, concurrency "
          f"{args.concurrency}, arrivals {args.request_rates} req/s"
          + (f"; {args.multiturn} concurrent 8-round chats" if args.multiturn else ""))
    print("\n| variant | req/s | TTFT mean | TTFT median | TTFT p90 | TTFT p99 | TPOT mean | inter-token p99 "
          "| chat round-8 TTFT | ViT on LM workers | ViT on encoders |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for rate, found in r.get("by_rate", {"": r}).items():
            print(row(r["variant"] + (f" @ {rate} req/s" if rate else ""), {**r, **found}))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
