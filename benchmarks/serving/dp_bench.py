"""Data-parallel replicas on one host: `glimpse serve --dp N` (dummy weights at a real shape) driven by the bench
client, one server after another on the same GPUs. Prints one table (req/s, TTFT, TPOT per N).

    python -m benchmarks.serving.dp_bench --checkpoints .bench/ckpt --shape 7b --dp 1,2 --num-prompts 128
    python -m benchmarks.serving.dp_bench --dp 2:affinity,2:round-robin --num-prompts 0 --multiturn 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from tests.server.live import free_port


def serve(
    model: Path, flags: list[str], log: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`glimpse serve` of ``model`` (dummy weights, a 16 GiB KV cache per replica) with ``flags`` added (and
    ``env`` over this process's environment), once /health answers: the process and its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--served-model-name", "bench",
           "--load-format", "dummy", "--port", str(port), "--kv-cache-mb", "16384", "--shm-budget-mb", "16384",
           "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, log, 400, 1.0)
    return proc, base


def wait_healthy(proc: subprocess.Popen[bytes], base: str, log: Path, timeout_s: float, every_s: float) -> None:
    """Poll ``base``/health every ``every_s`` until it answers 200; a server that exits first, or is still not
    healthy after ``timeout_s`` (then killed), raises with the end of its ``log``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(every_s)
    proc.kill()
    raise TimeoutError(log.read_text()[-3000:])


def bench(
    base: str, args: argparse.Namespace, out: Path, seed: int, images: int = 1, output_len: int = 128
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "server.cli", "bench", "serving", "--base-url", base + "/v1", "--out", str(out),
           "--num-prompts", str(args.num_prompts), "--concurrency", str(args.concurrency),
           "--images-per-request", str(images), "--resolution", "1080p", "--output-len", str(output_len),
           "--seed", str(seed), "--logprobs", "--request-rate", str(getattr(args, "request_rate", math.inf))]
    # --logprobs: every token arrives as a chunk of its own. Without it the client times chunks with text, and the
    # shape checkpoints' demo tokenizer is far smaller than their vocabulary, so most random-weight tokens decode
    # to none: most answers came as one chunk at their end, and TTFT, TPOT and the gaps measured the text.
    subprocess.run(cmd, check=True, capture_output=True)
    summary = json.loads(sorted(out.glob("*.json"))[-1].read_text())
    found: dict[str, Any] = summary.get("summary", summary)
    return found


def multiturn(base: str, chats: int, rounds: int, out: Path) -> dict[str, Any]:
    """``chats`` concurrent 8-round chats (one new 1080p image per round, the whole history resent): images
    encoded server-wide and the last round's TTFT, mean over chats."""
    before = httpx.get(base + "/admin/stats", timeout=10).json()["images_encoded"]
    procs = [
        subprocess.Popen([sys.executable, "-m", "server.cli", "bench", "multiturn", "--base-url", base + "/v1",
                          "--out", str(out / f"chat{i}"), "--rounds", str(rounds), "--resolution", "1080p",
                          "--output-len", "16", "--seed", str(1000 + i), "--logprobs"], stdout=subprocess.DEVNULL)
        for i in range(chats)
    ]
    for proc in procs:
        proc.wait()
    last: list[float] = []
    failed = no_ttft = 0
    for i in range(chats):
        result = json.loads(sorted((out / f"chat{i}").glob("*.json"))[-1].read_text())
        rows = result["rounds"]
        failed += sum(1 for r in rows if not r["ok"])
        # A TTFT is taken at the first streamed chunk with text; random weights often start with tokens that
        # decode to nothing, so such rounds have none (they still ran: see images_encoded).
        no_ttft += sum(1 for r in rows if r["ok"] and r.get("ttft_ms") is None)
        if rows and rows[-1].get("ttft_ms") is not None:
            last.append(rows[-1]["ttft_ms"])
    after = httpx.get(base + "/admin/stats", timeout=10).json()["images_encoded"]
    return {"chats": chats, "images_encoded": after - before, "ideal_encodes": chats * rounds,
            "failed_rounds": failed, "rounds_without_ttft": no_ttft, "last_round_ttft_ms": sum(last) / len(last) if last else None}


def load_flags(ap: argparse.ArgumentParser, shape: str, num_prompts: int) -> None:
    """The flags of a benchmark that serves one checkpoint in several server variants, one after another."""
    ap.add_argument("--shape", default=shape)
    ap.add_argument("--checkpoints", type=Path, default=None, help="a folder holding SHAPE (else config-only, here)")
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--multiturn", type=int, default=0, help="also: this many concurrent 8-round chats per server")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--request-rates", default="inf",
                    help="comma-separated Poisson arrival rates (req/s) of the serving run, each on the same server; "
                         "inf = all at once")  # fmt: skip


def request_rates(args: argparse.Namespace) -> list[float]:
    return [float(r) for r in str(args.request_rates).split(",") if r.strip()]


def measure(model: Path, flags: list[str], tmp: Path, tag: str, args: argparse.Namespace, seed: int,
            images: int = 1, stats: Callable[[str], dict[str, Any]] | None = None) -> dict[str, Any]:
    """One server variant: served, warmed up (8 requests), the serving run (``args.num_prompts`` requests of
    ``images`` 1080p images) and the chats of ``args.multiturn``, ``stats(base URL)`` added, then stopped."""
    proc, base = serve(model, flags, tmp / f"serve-{tag}.log")
    try:
        bench(base, argparse.Namespace(num_prompts=8, concurrency=8), tmp / f"warm-{tag}", seed=100 + seed)
        by_rate: dict[str, dict[str, Any]] = {}
        for i, rate in enumerate(request_rates(args) if args.num_prompts else []):
            # Each rate on its own seed: images the server already holds would skip their encodes.
            run = argparse.Namespace(**{**vars(args), "request_rate": rate})
            by_rate[str(rate)] = bench(base, run, tmp / f"run-{tag}-{i}", seed=seed + 10_000 * i, images=images)
        result = dict(next(iter(by_rate.values()), {}))
        if len(by_rate) > 1:
            result["by_rate"] = by_rate
        if args.multiturn:
            result["multiturn"] = multiturn(base, args.multiturn, 8, tmp / f"mt-{tag}")
        if stats is not None:
            result.update(stats(base))
    finally:
        proc.terminate()
        proc.wait(60)
    return result


def main() -> None:
    ap = parser(__doc__)
    load_flags(ap, "7b", 128)
    ap.add_argument("--dp", default="1,2")
    ap.add_argument("--routing", default="affinity")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        model = args.checkpoints / args.shape if args.checkpoints else shaped_checkpoint(tmp / "ckpt", args.shape)
        for dp, routing in ((int(n.split(":")[0]), (n.split(":") + [args.routing])[1]) for n in args.dp.split(",")):
            flags = ["--dp", str(dp), "--dp-routing", routing]
            result = measure(model, flags, tmp, f"{dp}-{routing}", args, seed=dp)
            rows.append({"dp": dp, "routing": routing, **result})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.shape}, {args.num_prompts} requests of 1 x 1080p, 128 out, concurrency {args.concurrency}")
    for r in rows:
        keys = {k: v for k, v in r.items() if isinstance(v, (int, float))}
        print(f"dp {r['dp']}: " + ", ".join(f"{k} {v:.3g}" for k, v in keys.items() if k != "dp"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
