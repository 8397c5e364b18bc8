"""A fresh server's first large requests against its later ones: what the side-by-side harness's (a) measures.

The harness sends one warm-up request (one 720p image) to a fresh server, then one request of 8 x 1080p images:
whatever that request meets for the first time (a tokenizer's first large image and prompt, the model worker's first
activations of that size, a GEMM kernel's first launch) counts in (a) and nowhere else. Here each server gets the
same warm-up, then ``--requests`` 8 x 1080p requests with new images each (the first is (a)'s), then one multiturn
chat of 8 rounds. The table shows every request's TTFT and the chat's last round.

    python -m benchmarks.serving.first_requests --model /tmp/ck7b --servers 2 -- \\
        --max-model-len 32768 --mm-cache-mb 8192 --max-num-seqs 128 --tokenizer-workers 4 \\
        --max-images-per-request 64 --num-kv-blocks 12288

With ``GLIMPSE_STEP_TRACE=DIR`` set, ``python -m benchmarks.tools.step_trace DIR --requests`` splits each request's time.
On a machine without a GPU it runs the demo model at 720p (``--resolution 720p``), which checks the plumbing only.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.args import parser
from server.cli import main as glimpse_cli
from tests.server.live import LiveServer


def bench(base: str, out: Path, mode: str, *flags: str) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    code = glimpse_cli(["bench", mode, "--base-url", base + "/v1", "--out", str(out), "--timeout", "300", *flags])
    files = sorted(out.glob(f"{mode}-*.json"))
    if code or not files:
        raise RuntimeError(f"bench {mode} {' '.join(flags)} failed (exit {code})")
    summary: dict[str, Any] = json.loads(files[-1].read_text())["summary"]
    return summary


def one_server(model: str, flags: list[str], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    started = time.monotonic()
    srv = LiveServer(Path(model), *flags, ready_timeout=600)
    row: dict[str, Any] = {"startup_s": time.monotonic() - started}
    try:
        bench(srv.base, out / "warm", "serving", "--num-prompts", "1", "--images-per-request", "1", "--resolution",
              "720p", "--output-len", "2", "--seed", "1")
        row["ttft_ms"] = []
        for i in range(args.requests):
            s = bench(srv.base, out / f"r{i}", "serving", "--num-prompts", "1", "--images-per-request",
                      str(args.images), "--resolution", args.resolution, "--output-len", "1", "--seed", str(2 + 10 * i))
            row["ttft_ms"].append(s["ttft_ms"]["mean"])
        chat = bench(srv.base, out / "chat", "multiturn", "--rounds", "8", "--resolution", args.resolution,
                     "--output-len", "16", "--seed", "4")
        row["chat_ms"] = chat["ttft_ms"]
    finally:
        srv.proc.terminate()
        srv.proc.wait(60)
    return row


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--requests", type=int, default=4, help="large requests per server after the warm-up")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--resolution", default="1080p")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("flags", nargs="*", help="after --: flags for glimpse serve")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.servers):
            rows.append(one_server(args.model, args.flags, args, Path(tmp) / f"s{i}"))
    print(f"\n{args.images} x {args.resolution} per request; TTFT ms, the first request after the warm-up first")
    print(f"{'server':>6} {'start s':>8} {'first':>8} {'later (each)':<32} {'chat round 1':>12} {'round 8':>8}")
    for i, r in enumerate(rows):
        later = ", ".join(f"{t:.0f}" for t in r["ttft_ms"][1:])
        print(f"{i:>6} {r['startup_s']:>8.1f} {r['ttft_ms'][0]:>8.1f} {later:<32} {r['chat_ms'][0]:>12.1f} "
              f"{r['chat_ms'][-1]:>8.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
