"""Decode throughput of the offline engine with the request features of issue 10, side by side in one run:
batch 32 plain vs every request under a JSON schema (grammar masks), penalties and logprobs, and n=4
(forked choices) vs the same prompts sent four times.

    .venv/bin/python -m benchmarks.engine.sampling_bench --shape 7b [--json out.json]
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from ipc.prompts import SamplingParams, StructuredSpec
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine

# Answers long enough for a decode measurement: the list must have 64 entries (bounded strings, so a random
# model closes each one), so every request runs to max_tokens, as the plain ones do.
SCHEMA = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string", "maxLength": 16},
        "total": {"type": "integer", "minimum": 0, "maximum": 99999},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 64},
    },
    "required": ["vendor", "total", "lines"],
    "additionalProperties": False,
}


def prompts(n: int) -> list[list[dict[str, Any]]]:
    return [[{"role": "user", "content": f"Request {i}: list every line of the invoice, one by one."}] for i in range(n)]


def run(engine: Engine, reqs: list[list[dict[str, Any]]], params: SamplingParams) -> dict[str, float]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    started = time.perf_counter()
    outs = engine.generate(reqs, params)
    sync()
    wall = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tok_per_s": round(tokens / wall, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--shape", choices=["demo", "7b"], default="demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each batch variant; the median is reported")
    ap.add_argument("--kv-cache-mb", type=int, default=None, help="default: 8192 on CUDA, 256 on the CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    kv_cache_mb = args.kv_cache_mb or (8192 if args.device.startswith("cuda") else 256)
    with tempfile.TemporaryDirectory() as tmp:
        model = shaped_checkpoint(Path(tmp) / "ckpt", args.shape)
        cfg = EngineConfig(
            model=str(model), device=args.device, load_format="dummy", max_model_len=4096, kv_cache_mb=kv_cache_mb,
            max_num_seqs=max(64, args.batch),
        )
        engine = Engine(cfg)
        base = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0)
        reqs = prompts(args.batch)
        run(engine, reqs[:4], msgspec.structs.replace(base, max_tokens=16))  # warm-up: graphs, kernels
        schema = msgspec.structs.replace(base, structured=StructuredSpec("json_schema", json.dumps(SCHEMA)))
        run(engine, reqs[:2], msgspec.structs.replace(schema, max_tokens=8))  # warm-up: the grammar compile
        variants = {
            "plain": base,
            "json_schema": schema,
            "penalties+logprobs": msgspec.structs.replace(base, presence_penalty=0.5, repetition_penalty=1.1, logprobs=5),
        }
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for _ in range(args.rounds):  # interleaved, so drift on the machine hits every variant alike
            for name, params in variants.items():
                runs[name].append(run(engine, reqs, params))
        rows: dict[str, dict[str, float]] = {
            name: sorted(r, key=lambda x: x["tok_per_s"])[len(r) // 2] for name, r in runs.items()
        }
        engine.core.prefix_caching = False  # both sides below prefill their prompts from scratch
        before = engine.core.prompt_tokens_computed
        rows["n=4"] = run(engine, reqs[: max(1, args.batch // 4)], msgspec.structs.replace(base, n=4))
        rows["n=4"]["prompt_tokens_computed"] = engine.core.prompt_tokens_computed - before
        before = engine.core.prompt_tokens_computed
        four = [r for r in reqs[: max(1, args.batch // 4)] for _ in range(4)]
        rows["4 separate"] = run(engine, four, base)
        rows["4 separate"]["prompt_tokens_computed"] = engine.core.prompt_tokens_computed - before
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"{args.shape} shapes, dummy weights, {device}, batch {args.batch}, up to {args.max_tokens} tokens each, "
          f"median of {args.rounds} (n=4 rows: one run)")
    for name, r in rows.items():
        print(f"{name:<20} {r['tok_per_s']:>9.1f} tok/s  {r['tokens']:>6} tokens  {r['wall_s']:>7.2f} s"
              + (f"  prompt tokens computed {r['prompt_tokens_computed']}" if "prompt_tokens_computed" in r else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
