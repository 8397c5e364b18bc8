"""Where a server's start-up goes: `glimpse serve` started ``--runs`` times on one checkpoint (dummy weights at a
published shape, or the demo model), each timed from the launch to the first 200 on /health, and cut into phases
by its own log lines. Prints one table, a row per run.

    python -m benchmarks.serving.startup_bench --shape qwen3-8b --runs 3
    python -m benchmarks.serving.startup_bench --shape qwen3-8b --runs 1 --cold    # kernel caches emptied first
    python -m benchmarks.serving.startup_bench --glimpse-root /tmp/base --shape qwen3-8b   # another tree's server
    python -m benchmarks.serving.startup_bench --shape qwen3.5-9b --runs 1 --cold --keep-logs /tmp/logs

Columns (seconds from the launch): the launcher's config built (its first child after the model workers
started); the model worker's imports done (its "loaded ... in X s" line, X before it); its weights allocated;
the embedding cache's host tier pinned (CUDA); its fused kernels compiled; its step shapes warmed; a hybrid model's state-snapshot paths warmed; its graphs captured; every child ready; /health answering; then, a duration, how long the model worker's garbage collections paused its start-up.
``--cold`` empties Triton's, Inductor's and FA4's caches and the skinny GEMM's tiles before each run (what a new
host or container pays); without it a run reuses what the runs before it compiled. The serving flags are the
vLLM side-by-side harness's (docs/benchmarks.md), so the last column is its start-up row.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from benchmarks.serving.dp_bench import wait_healthy
from tests.server.live import free_port

ROOT = Path(__file__).resolve().parents[2]
HARNESS_FLAGS = ["--max-model-len", "32768", "--mm-cache-mb", "8192", "--max-num-seqs", "128",
                 "--tokenizer-workers", "4", "--max-images-per-request", "64", "--num-kv-blocks", "12288"]  # fmt: skip
# The caches a cold start fills (workers/common/proc.py keep_kernel_caches, fa4_attention.py, skinny_tune.py).
KERNEL_CACHES = ["~/.triton/cache", "~/.cache/glimpse/inductor", "~/.cache/glimpse/flash-attn-cute",
                 "~/.cache/glimpse/skinny-tiles.json"]  # fmt: skip
# phase -> the log line that ends it (the first match, or the last for a phase in LAST; the model worker's rank 0)
PHASES: list[tuple[str, str]] = [
    ("config built", r"started (scheduler|tokenizer)\[0\]"),
    ("weights", r"glimpse\.model: \S+ ready: \d+ layers"),
    ("host tier", r"embedding host tier: .* pinned"),
    ("fused kernels", r"fused kernels ready"),
    ("step shapes", r"step shapes warmed"),
    ("state snapshots", r"state snapshot paths warmed"),  # a hybrid model's: fla's snapshot kernels (autotuned)
    ("graphs", r"graphs? \(.*\) captured|decode graphs captured"),
    ("all ready", r"all children ready"),
]
LAST = {"graphs"}  # the decode graphs, then the piecewise ones
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_LOADED = re.compile(r"glimpse\.model\[0\]: loaded \S+ in ([\d.]+)s")
_GC = re.compile(r"glimpse\.model\[0\]: start-up garbage collections: .* ([\d.]+) s paused")


def stamp(line: str) -> float | None:
    """The wall-clock time a log line was written (the log's local-time stamp), or None."""
    m = _STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def phases(log: str, launched: float) -> dict[str, float]:
    """Seconds from ``launched`` (time.time()) to the end of each phase the log shows."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        at = stamp(line)
        if at is None:
            continue
        if "imports" not in out and (m := _LOADED.search(line)):
            out["imports"] = at - float(m.group(1)) - launched
        if m := _GC.search(line):  # a duration, not a time: how long the model worker's collections paused it
            out["gc"] = float(m.group(1))
        for name, pattern in PHASES:
            if (name not in out or name in LAST) and re.search(pattern, line):
                out[name] = at - launched
    return out


def empty_kernel_caches() -> None:
    for entry in KERNEL_CACHES:
        path = Path(entry).expanduser()
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()


def start_once(model: Path, args: argparse.Namespace, log: Path) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port", str(port),
           "--log-level", "info", *args.flags, *shlex.split(args.serve_flags)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.glimpse_root), os.environ.get("PYTHONPATH", "")])}
    launched = time.time()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=args.glimpse_root, env=env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log, args.timeout, 0.1)
        row = phases(log.read_text(), launched)
        row["/health"] = time.time() - launched
        return row
    finally:
        proc.terminate()
        proc.wait(60)


def table(rows: list[dict[str, float]], names: list[str]) -> None:
    # the keys not named here are their own heads
    heads = {"imports": "model imports done", "host tier": "host tier pinned", "gc": "(model worker's GC pauses)"}
    cols = ["config built", "imports", *(name for name, _ in PHASES[1:]), "/health", "gc"]
    print("| run | " + " | ".join(f"{heads.get(c, c)}, s" for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, row in zip(names, rows):
        print(f"| {name} | " + " | ".join(f"{row[c]:.1f}" if c in row else "-" for c in cols) + " |")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", default="qwen3-8b", help='"demo" (the tiny demo model) or a benchmarks.checkpoints shape')
    ap.add_argument("--layers", type=int, default=0, help="decoder layers kept (0: all)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="empty the kernel caches before each run")
    ap.add_argument("--glimpse-root", type=Path, default=ROOT, help="the checkout whose server starts")
    ap.add_argument("--serve-flags", default="", help="more `glimpse serve` flags")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a start may take")
    ap.add_argument("--keep-logs", type=Path, default=None, help="copy each run's server log here (serve-N.log)")
    args = ap.parse_args()
    args.glimpse_root = args.glimpse_root.resolve()
    rows, names = [], []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        if args.shape == "demo":
            from workers.engine.models.demo_writer import ensure_demo_model

            model, args.flags = ensure_demo_model(), ["--max-model-len", "2048", "--tokenizer-workers", "2"]
        else:
            model = shaped_checkpoint(tmp / "ckpt", args.shape, layers=args.layers)
            args.flags = ["--load-format", "dummy", *HARNESS_FLAGS]
        for i in range(args.runs):
            if args.cold:
                empty_kernel_caches()
            try:
                rows.append(start_once(model, args, tmp / f"serve-{i}.log"))
            finally:  # a start that fails or times out is the log most worth keeping
                if args.keep_logs is not None:
                    args.keep_logs.mkdir(parents=True, exist_ok=True)
                    shutil.copy(tmp / f"serve-{i}.log", args.keep_logs / f"serve-{i}.log")
            names.append(f"{i + 1}{' (cold)' if args.cold else ''}")
            print(f"run {names[-1]}: /health after {rows[-1]['/health']:.1f} s", flush=True)
    print(f"\n{args.shape} ({args.layers or 'all'} layers), glimpse at {args.glimpse_root}")
    table(rows, names)


if __name__ == "__main__":
    main()
