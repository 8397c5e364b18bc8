"""Soak and slow-drip benchmarks against a real `glimpse serve` on loopback (demo model by default).

soak:  N clients of mixed load (soak_load.py: chat with 0-3 fresh or repeated images as data: or loopback http
       URLs, completions, streamed or not, disconnects mid-stream) for a warm-up and then ``--seconds``, bounded
       by ``--max-requests`` too. Every ``--interval`` s it samples each server process (launcher/frontend, each
       tokenizer, scheduler, each model worker: RSS, fds, threads), the launch's /dev/shm segments and
       /admin/stats (embedding-cache and shm bytes); prints a table at fixed marks; at the end a plateau verdict
       per process (RSS growth over the last half after warm-up), requests, failures (expected 0; disconnects
       counted apart), and writes ``<out>/soak.json`` and ``<out>/soak.png`` (memory over time).
drip:  requests/s of 1-image requests while 0, 2, 8 slow-drip image URLs are in flight.

    python -m benchmarks.serving.soak soak --seconds 240 --warmup 60 --clients 10 --out /tmp/soak
    python -m benchmarks.serving.soak soak --shape 7b --clients 48 --seconds 600 --out /tmp/soak-7b   # one GPU
    python -m benchmarks.serving.soak soak --url http://127.0.0.1:8000 --pid <launcher pid> --seconds 600
    python -m benchmarks.serving.soak drip --seconds 30 --drips 0,2,8

Exit status: 0 when the run had no failures, left no segment behind and every process was flat; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving.soak_load import Load, Mix
from benchmarks.serving.soak_procs import Sampler, plateau
from benchmarks.serving.soak_report import mark_every, plot, table, verdict_lines, write_json
from tests.media_server import MediaServer
from tests.server.live import LiveServer, data_url, image_message, png_bytes
from workers.engine.models.demo_writer import ensure_demo_model

IDLE_AFTER_S = 15.0  # sampled after the load stops too: what an idle server gives back (idle trims)


def start_server(args: argparse.Namespace, workdir: Path) -> LiveServer:
    """The server to soak: the CPU demo model, or with ``--shape`` a real-shaped checkpoint with random weights."""
    extra = ["--allow-private-media-addresses", "127.0.0.1", "--media-timeout", "10",
             "--tokenizer-workers", str(args.tokenizer_workers)]
    if args.shape:
        from benchmarks.checkpoints import shaped_checkpoint

        model = shaped_checkpoint(workdir / f"ckpt-{args.shape}", args.shape)
        extra += ["--load-format", "dummy"]
    else:
        model = args.model or ensure_demo_model()
    # LiveServer passes --num-kv-blocks 512 (the demo's size); a later flag wins, so --serve-args can override it.
    return LiveServer(model, *extra, *shlex.split(args.serve_args), ready_timeout=args.ready_timeout)


def launch_id_of(pid: int) -> str | None:
    """The --launch-id on a running server's command line (its /dev/shm segments are named after it)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    return argv[argv.index("--launch-id") + 1] if "--launch-id" in argv[:-1] else None


def run_soak(base: str, root: int | None, launch_id: str | None, media: MediaServer, args: argparse.Namespace,
             print_marks: bool = True) -> dict[str, Any]:
    """Drive the load and sample alongside it; returns the result document (samples included)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sampler = Sampler(root, base, launch_id, headers)
    load = Load(base, args.served_model_name, media.url("/img.png"), Mix(), headers)
    total = args.warmup + args.seconds
    every = args.mark_every or mark_every(total)
    stop = threading.Event()

    def sample_loop() -> None:
        next_mark = 0.0
        while True:
            row = sampler.take()
            if print_marks and row["t"] >= next_mark:
                res = load.result
                print(table(row, res.requests, res.failures, res.outcomes["disconnect"]), flush=True)
                next_mark += every
            if stop.wait(args.interval):
                return

    thread = threading.Thread(target=sample_loop, name="soak-sampler", daemon=True)
    thread.start()
    try:
        asyncio.run(load.run(args.clients, total, args.max_requests, args.seed))
        load_s = time.monotonic() - sampler.started
        time.sleep(IDLE_AFTER_S)  # aborted requests finish releasing, idle trims run
    finally:
        stop.set()
        thread.join()
    idle = sampler.take()
    loaded = [s for s in sampler.samples[:-1] if s["t"] <= load_s]  # the verdict is about the loaded run
    verdict = plateau(loaded, args.warmup, args.flat_mib, args.flat_pct)
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "cores": os.cpu_count(), "load_s": round(load_s, 1), **load.result.summary(),
            "plateau": verdict, "idle_after": idle, "samples": sampler.samples}


def soak_main(args: argparse.Namespace) -> int:
    media = MediaServer(png_bytes(800, 600, seed=9))
    server: LiveServer | None = None
    with tempfile.TemporaryDirectory(prefix="glimpse-soak-") as tmp:
        try:
            if args.url:
                base, root = args.url.rstrip("/"), args.pid
                launch_id = args.launch_id or (launch_id_of(root) if root else None)
            else:
                server = start_server(args, Path(tmp))
                base, root, launch_id = server.base, server.proc.pid, server.launch_id
            result = run_soak(base, root, launch_id, media, args)
            result["healthy_after"] = httpx.get(base + "/health", timeout=5).status_code == 200
        finally:
            if server is not None:
                exit_code = server.stop()
            media.close()
        if server is not None:
            result["exit"] = exit_code
            result["segments_left"] = len(server.segments())
    print(verdict_lines(result["plateau"]))
    print(f"requests {result['requests']} ok {result['ok']} failures {result['failures']} "
          f"disconnects {result['disconnects']} cut {result['cut']} p50 {result['p50_s']} s p99 {result['p99_s']} s; "
          f"segments left {result.get('segments_left', 'n/a')}; outcomes {result['outcomes']}")
    out: Path = args.out
    write_json(out / "soak.json", result)
    title = f"glimpse soak: {args.shape or 'demo'}, {args.clients} clients, {result['load_s']:.0f} s"
    plot(out / "soak.png", result["samples"], args.warmup, title)
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    flat = all(v["flat"] for v in result["plateau"].values())
    return 0 if result["failures"] == 0 and not result.get("segments_left") and flat else 1


async def drip(server: LiveServer, media: MediaServer, seconds: float, drips: int) -> float:
    """Requests/s of sequential-by-client 1-image requests (4 clients) while ``drips`` drip URLs hang."""
    image = png_bytes(640, 480, seed=1)
    body = {"model": "demo", "messages": image_message("Describe.", [data_url(image)]), "max_tokens": 4}
    slow = {"model": "demo", "messages": image_message("Slow.", [media.url("/drip")]), "max_tokens": 4}
    done = 0
    deadline = time.monotonic() + seconds

    async def dripper(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            await client.post(server.base + "/v1/chat/completions", json=slow)  # ends at the media deadline

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            resp = await client.post(server.base + "/v1/chat/completions", json=body)
            done += resp.status_code == 200

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        started = time.monotonic()
        await asyncio.gather(*(dripper(client) for _ in range(drips)), *(worker(client) for _ in range(4)))
        return done / (time.monotonic() - started)


def drip_main(args: argparse.Namespace) -> int:
    model = args.model or ensure_demo_model()
    media = MediaServer(png_bytes(800, 600, seed=9))
    server = LiveServer(model, "--allow-private-media-addresses", "127.0.0.1", "--media-timeout", "5")
    try:
        result: dict[str, Any] = {"mode": "drip", "cores": os.cpu_count()}
        result["req_per_s"] = {n: asyncio.run(drip(server, media, args.seconds, int(n))) for n in args.drips.split(",")}
    finally:
        result["exit"] = server.stop()
        result["segments_left"] = len(server.segments())
        media.close()
    print(json.dumps(result, indent=2))
    write_json(args.out / "drip.json", result)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["soak", "drip"])
    ap.add_argument("--seconds", type=float, default=240, help="load after the warm-up (soak); per setting (drip)")
    ap.add_argument("--warmup", type=float, default=60, help="first seconds of load, left out of the verdict")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--max-requests", type=int, default=1_000_000, help="stop after this many requests")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    ap.add_argument("--mark-every", type=float, default=0, help="seconds between printed tables (0: by duration)")
    ap.add_argument("--flat-mib", type=float, default=24, help="growth over the last half still called flat ...")
    ap.add_argument("--flat-pct", type=float, default=2.0, help="... or this %% of RSS, whichever is larger")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/glimpse-soak"))
    ap.add_argument("--model", type=Path, default=None, help="checkpoint to serve (default: the demo model)")
    ap.add_argument("--shape", default=None, help="serve a real-shaped checkpoint with dummy weights (e.g. 7b)")
    ap.add_argument("--tokenizer-workers", type=int, default=2)
    ap.add_argument("--serve-args", default="", help="more `glimpse serve` flags, one string")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--url", default=None, help="soak a running server at this loopback URL instead")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the launcher's pid (per-process samples)")
    ap.add_argument("--launch-id", default=None, help="with --url: its launch id (default: from its command line)")
    ap.add_argument("--served-model-name", default="demo")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--drips", default="0,2,8")
    args = ap.parse_args(argv)
    if args.url and not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        ap.error("--url: loopback only (http://127.0.0.1:PORT)")
    return args


def main() -> None:
    args = parse_args()
    raise SystemExit(soak_main(args) if args.mode == "soak" else drip_main(args))


if __name__ == "__main__":
    main()
