"""Tokenizer throughput: 1080p JPEG images per second through one and through two tokenizer workers,
and the latency of a request with many fresh images for each size of a tokenizer's image thread pool.

Real tokenizer processes (`run_tokenizer`, spawned like the launcher does) on real sockets and
/dev/shm, with the Qwen2.5-VL-7B-shaped checkpoint (real 12,845,056 max_pixels, so a 1080p image is
1092 x 1932 = 10,764 patches) and pixels as the server writes them (uint8 frames). This script plays the frontend and the
scheduler: it binds PULL at `frontend` and `sched`, pushes GenerateRequests to `tok{i}` round-robin,
and unlinks every segment it receives (the scheduler's job), so /dev/shm never fills up.

Each request is one chat message with `--images-per-request` distinct random 1920x1080 JPEGs
(quality 90, default 1) as data URLs, so nothing is reused. Every worker has `--depth` requests in
flight (default 1: the latency is the worker's own time per request, not queueing); images/s runs
from the first send to the last TokenizedRequest. `--reuse` adds a pass that sends the same images
again and again: the reuse path (hash the bytes, hard-link a live segment; no decode, processing or
write). `--threads` runs every worker count once per size of each tokenizer's image thread pool
(`--tokenizer-threads`; 0 or auto: cores / workers), on the same images.

    python -m benchmarks.request_path.tokenizer_bench --workers 1,2 --requests 24 --reuse --json tok.json
    python -m benchmarks.request_path.tokenizer_bench --workers 1 --images-per-request 8 --threads 1,auto --requests 6
    python -m benchmarks.request_path.tokenizer_bench --workers 1 --images-per-request 8 --format png --requests 6   # pages as PNG
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from ipc.channels import Poller, PullSocket, PushSocket, new_context
from ipc.control import ProcessReady, RequestFailed, Shutdown
from ipc.inbound import FrontendInbound, SchedulerInbound, TokenizerInbound
from ipc.launch import cleanup_launch_dir, ipc_address, new_launch_id
from ipc.prompts import MediaReady, TokenizedRequest
from ipc.requests import GenerateRequest
from ipc.shm import ShmSegment, list_segments, sweep
from server.config import ServerConfig
from workers.engine.config import EngineConfig
from workers.tokenizer.media.image_prep import core_share
from workers.tokenizer.process import run_tokenizer

MODEL = "bench"


def image_bytes(width: int, height: int, seed: int, content: str, quality: int, fmt: str = "jpeg") -> bytes:
    """A distinct JPEG (or PNG): uniform noise (worst case for the decoder), or a smooth photo-like picture."""
    rng = np.random.default_rng(seed)
    if content == "noise":
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        image = Image.fromarray(pixels)
    else:  # "photo": a few large blobs of colour plus mild grain, closer to a real photo's JPEG size
        small = Image.fromarray(rng.integers(0, 256, (9, 16, 3), dtype=np.uint8))
        base = np.asarray(small.resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
        grain = rng.integers(-6, 7, (height, width, 3), dtype=np.int16)
        image = Image.fromarray(np.clip(base + grain, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    if fmt == "png":
        image.save(buf, format="PNG")
    else:
        image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def chat_body(raws: list[bytes]) -> bytes:
    content: list[dict[str, Any]] = [{"type": "text", "text": "Describe the images."}]
    for raw in raws:
        mime = "image/png" if raw.startswith(b"\x89PNG") else "image/jpeg"
        url = f"data:{mime};base64,{base64.b64encode(raw).decode()}"
        content.append({"type": "image_url", "image_url": {"url": url}})
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16}
    return json.dumps(body).encode()


class Peer:
    """Frontend and scheduler ends of the sockets, plus the frontend's pushes to every tokenizer."""

    def __init__(self, launch_id: str, workers: int) -> None:
        self.ctx = ctx = new_context()
        self.frontend = PullSocket[FrontendInbound](ctx, ipc_address(launch_id, "frontend"), FrontendInbound, True)
        self.sched = PullSocket[SchedulerInbound](ctx, ipc_address(launch_id, "sched"), SchedulerInbound, True)
        self.toks = [
            PushSocket[TokenizerInbound](ctx, ipc_address(launch_id, f"tok{i}"), TokenizerInbound, False)
            for i in range(workers)
        ]
        self.arrived: dict[str, tuple[TokenizedRequest, set[bytes], float]] = {}  # images still being written
        self.poller = Poller()
        self.poller.register(self.frontend)
        self.poller.register(self.sched)

    def wait_ready(self, workers: int, timeout_s: float) -> None:
        deadline, seen = time.monotonic() + timeout_s, set[int]()
        while len(seen) < workers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"tokenizers {sorted(set(range(workers)) - seen)} never got ready")
            msg = self.frontend.recv(int(left * 1000) + 1)
            if isinstance(msg, ProcessReady) and msg.role == "tokenizer":
                seen.add(msg.index)

    def next_tokenized(self, timeout_s: float = 120.0) -> tuple[TokenizedRequest, float]:
        """The next request whose images are all written, and when it reached the scheduler (perf_counter): with
        overlap a request arrives before its later images (TokenizedRequest.pending, then MediaReady for each).
        Frontend traffic (accepts, stats) is drained on the way."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            for channel in self.poller.poll(int(left * 1000) + 1):
                if channel is self.frontend:
                    msg = self.frontend.recv(0)
                    if isinstance(msg, RequestFailed):
                        raise RuntimeError(f"tokenizer refused {msg.rid}: {msg.status} {msg.message}")
                    continue
                got = self.sched.recv(0)
                if isinstance(got, TokenizedRequest):
                    self.arrived[got.rid] = (got, set(got.pending), time.perf_counter())
                elif isinstance(got, MediaReady):
                    self.arrived[got.rid][1].difference_update(got.hashes)
                else:
                    continue
                rid = got.rid
                if not self.arrived[rid][1]:
                    req, _, at = self.arrived.pop(rid)
                    return req, at
        raise TimeoutError("no TokenizedRequest in time")

    def close(self) -> None:
        self.frontend.close()
        self.sched.close()
        for sock in self.toks:
            sock.close()
        self.ctx.term()


@dataclass
class PassResult:
    workers: int
    threads: int  # each tokenizer's image thread pool (resolved: never 0)
    threads_auto: bool  # resolved from --threads auto (cores / workers)
    mode: str  # "fresh": distinct images; "reuse": the same images resent (hard links)
    requests: int
    images_per_request: int
    seconds: float
    images_per_s: float
    shm_mb_per_s: float
    shm_bytes: int
    latency_p50_ms: float  # of a request, all its images
    latency_p90_ms: float
    handoff_p50_ms: float  # until the request reached the scheduler (before its later images, with overlap)
    cpu_ms_per_image: float  # tokenizer processes' CPU time (user + system): robust to a busy machine


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the processes so far (Linux /proc), all their threads included."""
    total = 0
    for pid in pids:
        # The command name (field 2) may hold spaces; the fields after its ")" are fixed.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def run_pass(
    peer: Peer,
    bodies: list[bytes],
    mode: str,
    depth: int,
    keep: set[str],
    pids: list[int],
    per_request: int = 1,
    threads: int = 1,
    auto: bool = False,
) -> PassResult:
    """Send every body round-robin, `depth` in flight per worker; unlink each request's segments
    on arrival except the names in `keep`."""
    n = len(peer.toks)
    queues: list[deque[tuple[str, bytes]]] = [deque() for _ in range(n)]
    for k, body in enumerate(bodies):
        queues[k % n].append((f"{mode}-{n}-{k}", body))
    sent: dict[str, tuple[int, float]] = {}

    def send_next(worker: int) -> None:
        if queues[worker]:
            rid, body = queues[worker].popleft()
            sent[rid] = (worker, time.perf_counter())
            peer.toks[worker].send(GenerateRequest(rid, memoryview(body), time.time()))

    cpu0 = cpu_seconds(pids)
    t0 = time.perf_counter()
    for _ in range(depth):
        for w in range(n):
            send_next(w)
    latencies: list[float] = []
    handoffs: list[float] = []
    shm_bytes = 0
    for _ in bodies:
        req, arrived = peer.next_tokenized()
        worker, t_sent = sent.pop(req.rid)
        latencies.append(time.perf_counter() - t_sent)
        handoffs.append(arrived - t_sent)
        shm_bytes += req.shm_bytes
        if mode == "reuse" and req.shm_bytes:
            raise RuntimeError(f"{req.rid} wrote {req.shm_bytes} bytes: the image was not reused")
        for name in req.shm_names:
            if name not in keep:
                ShmSegment.unlink(name)
        send_next(worker)
    seconds = time.perf_counter() - t0
    cpu = cpu_seconds(pids) - cpu0
    quantiles = statistics.quantiles(latencies, n=10) if len(latencies) > 1 else latencies * 9
    images = len(bodies) * per_request
    return PassResult(
        workers=n,
        threads=threads,
        threads_auto=auto,
        mode=mode,
        requests=len(bodies),
        images_per_request=per_request,
        seconds=seconds,
        images_per_s=images / seconds,
        shm_mb_per_s=shm_bytes / 2**20 / seconds,
        shm_bytes=shm_bytes,
        latency_p50_ms=statistics.median(latencies) * 1000,
        latency_p90_ms=quantiles[8] * 1000,
        handoff_p50_ms=statistics.median(handoffs) * 1000,
        cpu_ms_per_image=cpu / images * 1000,
    )


def bench_workers(
    model_dir: Path, n: int, threads: int, args: argparse.Namespace, seed: int
) -> list[PassResult]:
    launch_id = new_launch_id()
    engine = EngineConfig(model=str(model_dir), dtype="bfloat16", max_model_len=args.max_model_len)
    # The budget is the scheduler's to enforce (it reports usage back); this script unlinks at once instead.
    config = ServerConfig(
        engine=engine, launch_id=launch_id, served_model_name=MODEL, tokenizer_workers=n, shm_budget_bytes=1 << 40,
        tokenizer_threads=threads, overlap_media=args.overlap,
    )
    per = args.images_per_request
    pool = threads or core_share(config)  # as each tokenizer resolves it
    peer = Peer(launch_id, n)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=run_tokenizer, args=(config, i), daemon=True) for i in range(n)]
    for proc in procs:
        proc.start()
    try:
        peer.wait_ready(n, timeout_s=300)

        def make(s: int) -> bytes:  # request s: images s * per ... s * per + per - 1
            return chat_body([image_bytes(1920, 1080, s * per + j, args.content, args.quality, args.format) for j in range(per)])

        # Warm-up, one request per worker: first-call costs (lazy imports, pool threads) stay out of the numbers.
        pids = [p.pid for p in procs if p.pid is not None]

        def run(bodies: list[bytes], mode: str, depth: int, keep: set[str]) -> PassResult:
            return run_pass(peer, bodies, mode, depth, keep, pids, per, pool, threads == 0)

        run([make(seed + 10_000 + w) for w in range(n)], "warmup", 1, set())
        bodies = [make(seed + k) for k in range(args.requests)]
        results = [run(bodies, "fresh", args.depth, set())]
        if args.reuse:
            # The first send writes the images; their segments stay alive (as for a chat's next turn),
            # so every later send of the same bytes links them.
            seed_body = make(seed + 20_000)
            peer.toks[0].send(GenerateRequest("reuse-seed", memoryview(seed_body), time.time()))
            keep = set(peer.next_tokenized()[0].shm_names)
            reuse = [seed_body] * (args.requests * 4)
            results.append(run(reuse, "reuse", args.depth, keep))
            for name in keep:
                ShmSegment.unlink(name)
        for sock in peer.toks:
            sock.send(Shutdown("benchmark over"))
        for proc in procs:
            proc.join(30)
        return results
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        peer.close()
        leftovers = list_segments(launch_id)
        sweep(launch_id)
        cleanup_launch_dir(launch_id)
        if leftovers:
            print(f"warning: swept {len(leftovers)} segments the benchmark did not unlink")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--workers", default="1,2", help="comma-separated tokenizer worker counts to run")
    ap.add_argument("--requests", type=int, default=24, help="requests (of distinct images) per pass")
    ap.add_argument("--images-per-request", type=int, default=1, help="distinct images in each request")
    ap.add_argument(
        "--threads", default="auto", help="comma-separated image thread pool sizes per tokenizer (auto or 0: cores / workers)"
    )
    ap.add_argument("--depth", type=int, default=1, help="requests in flight per worker")
    ap.add_argument("--content", choices=["noise", "photo"], default="noise")
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality")
    ap.add_argument("--format", choices=["jpeg", "png"], default="jpeg", help="the images' encoding")
    ap.add_argument("--reuse", action="store_true", help="also measure resending one image (4x requests)")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--no-overlap", dest="overlap", action="store_false",
                    help="hand requests on only once every image is written (glimpse serve --no-overlap-media)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    # Other processes on the box skew CPU numbers: the 1-minute load before we start goes with the table.
    load_before = os.getloadavg()[0]
    sizes = [len(image_bytes(1920, 1080, s, args.content, args.quality, args.format)) for s in range(3)]
    pools = [0 if t.strip() == "auto" else int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = shaped_checkpoint(Path(tmp) / "ckpt", "7b")
        results: list[PassResult] = []
        for i, n in enumerate(int(w) for w in args.workers.split(",")):
            for threads in pools:  # the same images for every pool size
                results += bench_workers(model_dir, n, threads, args, seed=i * 100_000)

    machine = f"{platform.machine()}, {os.cpu_count()} cores, load {load_before:.2f} before the run"
    kind = "PNG" if args.format == "png" else f"JPEG q{args.quality}"
    print(f"\n1920x1080 {kind} ({args.content}, ~{statistics.mean(sizes) / 1024:.0f} KB), "
          f"7B-shaped processor (1092x1932, 10,764 patches), uint8 frames, {args.images_per_request} images "
          f"per request, depth {args.depth}; {machine}; p50/p90: latency of one request (all images written); handoff: p50 until it reached the scheduler")
    print(f"{'workers':>7} {'threads':>7} {'mode':6} {'requests':>8} {'images':>6} {'images/s':>9} {'shm MB/s':>9} "
          f"{'p50 ms':>8} {'p90 ms':>8} {'handoff':>8} {'CPU ms/img':>10}")
    for r in results:
        pool = f"auto={r.threads}" if r.threads_auto else str(r.threads)
        print(f"{r.workers:>7} {pool:>7} {r.mode:6} {r.requests:>8} {r.requests * r.images_per_request:>6} "
              f"{r.images_per_s:>9.2f} {r.shm_mb_per_s:>9.1f} "
              f"{r.latency_p50_ms:>8.1f} {r.latency_p90_ms:>8.1f} {r.handoff_p50_ms:>8.1f} {r.cpu_ms_per_image:>10.1f}")
    if args.json:
        doc: dict[str, Any] = {
            "machine": machine,
            "args": vars(args) | {"json": str(args.json)},
            "jpeg_bytes_mean": statistics.mean(sizes),
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
