"""A fresh server's first load against its second, server after server.

The side-by-side harness starts a fresh server for every bench, so whatever a server meets for the first time
under load (a kernel compiled mid-serving, a library's first call, a long garbage collection) counts against it
there and nowhere else. Each server here gets the harness's order: a warm-up request, one request of 8 images,
then the same 64-concurrent load twice (different seeds, so no image cache carries over). The table shows each
load's req/s and TPOT, the longest a plan waited for the model worker (``broadcast_ms_max``: a host stall of the
worker shows there), the model worker's longest collection pause, and how many files the Triton cache gained
after "ready" (a kernel compiled while serving).

    python -m benchmarks.serving.first_load --model /tmp/ck7b --servers 2 --empty-triton-cache -- \\
        --max-model-len 32768 --mm-cache-mb 8192 --max-num-seqs 128 --tokenizer-workers 4 \\
        --max-images-per-request 64 --num-kv-blocks 12288

On a machine without a GPU it runs the demo model at a small load (``--prompts 8``), which checks the plumbing only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.server.live import LiveServer
from workers.engine.models.demo_writer import ensure_demo_model


def bench(base: str, out: Path, *args: str) -> dict[str, Any]:
    """One `glimpse bench serving` run; its summary."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.json"))
    cmd = [sys.executable, "-m", "server.cli", "bench", "serving", "--base-url", base + "/v1", "--out", str(out), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    [new] = set(out.glob("*.json")) - before
    summary: dict[str, Any] = json.loads(new.read_text())["summary"]
    return summary


def files_since(folder: Path, since: float) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file() and p.stat().st_mtime >= since) if folder.exists() else 0


def one_server(model: Path, serve_args: list[str], args: argparse.Namespace, index: int) -> list[dict[str, Any]]:
    env: dict[str, str] = {}
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    if args.empty_triton_cache:
        scratch = Path(tempfile.mkdtemp(prefix=f"first-load-{index}-"))
        cache = scratch / "triton"
        env = {"TRITON_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor")}
    started = time.monotonic()
    server = LiveServer(model, *serve_args, env=env, ready_timeout=args.ready_timeout)
    ready_s, ready = time.monotonic() - started, time.time()
    rows = []
    try:
        out = Path(tempfile.mkdtemp(prefix="first-load-bench-"))
        common = ["--timeout", "300", "--resolution", args.resolution]
        bench(server.base, out, *common, "--num-prompts", "1", "--images-per-request", "1", "--output-len", "2",
              "--seed", "1", "--resolution", "720p")  # fmt: skip
        single = bench(server.base, out, *common, "--num-prompts", "1", "--images-per-request", "8",
                       "--output-len", "1", "--seed", "2")  # fmt: skip
        for load, seed in enumerate((3, 13)):
            summary = bench(server.base, out, *common, "--num-prompts", str(args.prompts), "--concurrency",
                            str(args.prompts), "--images-per-request", "1", "--output-len", "128", "--seed", str(seed))  # fmt: skip
            stats = server.stats()
            worker = stats["model_workers"][0]
            rows.append({
                "server": index, "load": load + 1, "ready_s": ready_s, "a_ttft_ms": single["ttft_ms"]["mean"],
                "req_s": summary["request_throughput"], "tpot_ms": summary["tpot_ms"]["mean"],
                "wait_ms": worker["broadcast_ms_max"], "gc_ms": worker["gc"]["pause_ms_max"],
                "cache_files": files_since(cache, ready),
            })  # fmt: skip
            ready = time.time()  # the next row counts only its own load's compiles
    finally:
        server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the built-in demo model)")
    parser.add_argument("--servers", type=int, default=2, help="fresh servers, one after the other")
    parser.add_argument("--prompts", type=int, default=64, help="requests (and concurrency) of each load")
    parser.add_argument("--resolution", default="1080p")
    parser.add_argument("--empty-triton-cache", action="store_true", help="each server starts with its own empty "
                        "Triton and Inductor caches, as on a fresh machine")  # fmt: skip
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    args, serve_args = parser.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    model = args.model or ensure_demo_model()
    rows = [row for i in range(args.servers) for row in one_server(model, serve_args, args, i + 1)]
    print(f"{'server':>6} {'load':>4} {'ready s':>8} {'(a) ms':>8} {'req/s':>7} {'TPOT ms':>8} {'wait ms':>8} "
          f"{'gc ms':>7} {'compiled':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['server']:>6} {r['load']:>4} {r['ready_s']:>8.1f} {r['a_ttft_ms']:>8.0f} {r['req_s']:>7.2f} "
              f"{r['tpot_ms']:>8.1f} {r['wait_ms']:>8.0f} {r['gc_ms']:>7.0f} {r['cache_files']:>8}")  # fmt: skip
    print("\nwait ms: the longest a plan waited for the model worker so far in that server; compiled: files the "
          "Triton cache gained during that load (a kernel compiled while serving)")


if __name__ == "__main__":
    main()
