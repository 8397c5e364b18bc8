"""glimpse, glimpse in baseline mode and transformers' generate, on the same weights, in one run.

Writes a random-weight Qwen2.5-VL-7B-shaped checkpoint once (transformers' own init, bf16), times
transformers on it in this process, then serves it with glimpse twice (per-image cache, then
`--mm-cache-mode request`) and drives each server with `glimpse bench`. Prints one table per target.

    python -m benchmarks.side_by_side --out results/
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

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from benchmarks.engine.engine_bench import RESOLUTIONS, messages_with, noise_image
from server.cli import main as glimpse_cli
from tests.server.live import LiveServer


def write_weights(ckpt: Path) -> None:
    """transformers' init of the 7B shapes, saved as safetensors: both sides load these bytes."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    config = AutoConfig.from_pretrained(str(ckpt))
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    # The demo tokenizer knows ~2000 ids of the 152k vocabulary: make the rest (and the special
    # tokens) unreachable, so every generated token decodes to text and streams as a chunk.
    from transformers import AutoTokenizer

    first_special = min(AutoTokenizer.from_pretrained(str(ckpt)).all_special_ids)
    with torch.no_grad():
        model.lm_head.weight[first_special:] = 0
    model.save_pretrained(str(ckpt), max_shard_size="20GB")
    del model
    gc.collect()
    torch.cuda.empty_cache()


def transformers_side(ckpt: Path, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(ckpt))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(ckpt), dtype=args.torch_dtype, attn_implementation="sdpa", device_map=args.device
    ).eval()

    def generate(images: list[Any], new_tokens: int, model: Any = model) -> float:
        t0 = time.perf_counter()
        inputs = processor.apply_chat_template(
            messages_with(images, "Summarise these pages."), tokenize=True, add_generation_prompt=True,
            return_dict=True, return_tensors="pt",
        ).to(args.device)
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    w, h = RESOLUTIONS["1080p"]
    generate([noise_image(448, 448, 999)], 2)  # warm-up
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ttft = generate([noise_image(w, h, seed=i) for i in range(8)], 1)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    times = [generate([noise_image(w, h, seed=100 + i)], args.output_len) for i in range(args.hf_requests)]
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"ttft_8x1080p_s": ttft, "peak_gib_8x1080p": peak / 2**30,
            "req_s_1x1080p": len(times) / sum(times), "tok_s_1x1080p": len(times) * args.output_len / sum(times)}


def bench(server: LiveServer, out: Path, mode: str, *flags: str) -> dict[str, Any]:
    before = set(out.glob(f"{mode}-*.json"))
    code = glimpse_cli(["bench", mode, "--base-url", server.base + "/v1", "--out", str(out), *flags])
    [path] = set(out.glob(f"{mode}-*.json")) - before
    result: dict[str, Any] = json.loads(path.read_text())
    result["exit_code"] = code
    return result


def glimpse_side(ckpt: Path, out: Path, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    server = LiveServer(ckpt, "--max-model-len", "131072", "--mm-cache-mb", "8192", "--max-num-seqs", "128",
                        "--tokenizer-workers", str(args.tokenizer_workers), "--max-images-per-request", "64",
                        "--num-kv-blocks", str(args.kv_blocks), *extra, ready_timeout=600)
    res: dict[str, Any] = {}
    try:
        bench(server, out, "serving", "--num-prompts", "1", "--images-per-request", "1", "--resolution", "720p",
              "--output-len", "2", "--seed", "1")  # warm-up
        # --logprobs: each token is a chunk the client times. The shape checkpoints' demo tokenizer is far smaller
        # than their vocabulary, so most random-weight tokens decode to no text, and timing text chunks measured
        # when text happened to come (docs/benchmarks.md "Encoder workers").
        one = bench(server, out, "serving", "--num-prompts", "1", "--images-per-request", "8", "--resolution",
                    "1080p", "--output-len", "1", "--seed", "2", "--logprobs")
        res["ttft_8x1080p_s"] = one["summary"]["ttft_ms"]["mean"] / 1e3
        tput = bench(server, out, "serving", "--num-prompts", "64", "--concurrency", "64", "--images-per-request",
                     "1", "--resolution", "1080p", "--output-len", str(args.output_len), "--seed", "3", "--logprobs")
        res["serving_64x1080p"] = tput["summary"]
        turns = bench(server, out, "multiturn", "--rounds", "8", "--resolution", "1080p", "--output-len", "16",
                      "--seed", "4", "--logprobs")
        res["multiturn"] = {"ttft_ms": turns["summary"]["ttft_ms"], "images_encoded": turns["summary"]["images_encoded"]}
        if not args.skip_probe:
            probe = bench(server, out, "probe", "--resolution", "2k", "--max-images", str(args.probe_max),
                          "--step", str(args.probe_step), "--seed", "5")
            res["probe_2k"] = [{k: p.get(k) for k in ("num_images", "ok", "ttft_ms", "prompt_tokens", "peak_gpu_bytes")}
                               for p in probe["probes"]]
            res["probe_first_failure"] = probe.get("first_failure")
        res["stats"] = server.stats()
    finally:
        server.stop()
    return res


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--out", type=Path, default=Path("side-by-side"))
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-requests", type=int, default=2)
    ap.add_argument("--kv-blocks", type=int, default=12288)
    ap.add_argument("--tokenizer-workers", type=int, default=4)
    ap.add_argument("--probe-max", type=int, default=28)
    ap.add_argument("--probe-step", type=int, default=4)
    ap.add_argument("--skip-probe", action="store_true")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--shape", choices=["7b", "demo"], default="7b", help="demo: a CPU smoke run of this script")
    args = ap.parse_args()
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.torch_dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    args.out.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results: dict[str, Any] = {"card": card}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = shaped_checkpoint(Path(tmp) / "ckpt", args.shape)
        t0 = time.perf_counter()
        if args.shape == "7b":
            write_weights(ckpt)
        print(f"weights written in {time.perf_counter() - t0:.1f}s", flush=True)
        results["transformers"] = transformers_side(ckpt, args)
        print("transformers:", json.dumps(results["transformers"]), flush=True)
        results["glimpse"] = glimpse_side(ckpt, args.out, args)
        print("glimpse done", flush=True)
        if not args.skip_baseline:
            results["baseline"] = glimpse_side(ckpt, args.out, args, "--mm-cache-mode", "request")
    (args.out / "side_by_side.json").write_text(json.dumps(results, indent=2, default=str))
    report(results)


def report(r: dict[str, Any]) -> None:
    hf, g, b = r["transformers"], r["glimpse"], r.get("baseline", {})
    print(f"\n== {r['card']}, Qwen2.5-VL-7B shapes, bf16, same random weights ==")
    print(f"TTFT 8 x 1080p: transformers {hf['ttft_8x1080p_s']:.3f} s | glimpse {g['ttft_8x1080p_s']:.3f} s"
          + (f" | baseline {b['ttft_8x1080p_s']:.3f} s" if b else ""))
    s = g["serving_64x1080p"]
    print(f"64 x (1 x 1080p, 128 out): glimpse {s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} tok/s"
          f" | transformers (sequential) {hf['req_s_1x1080p']:.3f} req/s -> {s['request_throughput'] / hf['req_s_1x1080p']:.1f}x")
    print("multiturn TTFT ms per round: glimpse", [round(x) for x in g["multiturn"]["ttft_ms"]],
          "encoded", g["multiturn"]["images_encoded"])
    if b:
        print("multiturn TTFT ms per round: baseline", [round(x) for x in b["multiturn"]["ttft_ms"]],
              "encoded", b["multiturn"]["images_encoded"])
    for p in g.get("probe_2k", []):
        peak = p["peak_gpu_bytes"]
        print(f"probe 2K x {p['num_images']:>2}: ok={p['ok']} TTFT {p['ttft_ms'] or 0:.0f} ms, tokens {p['prompt_tokens']},"
              f" peak {peak / 2**30 if peak else 0:.2f} GiB")


if __name__ == "__main__":
    main()
