"""Soak and slow-drip benchmarks against a real `glimpse serve` on loopback (demo model by default).

soak:  N clients for D seconds, mixed requests (text; 1-3 images as data: URLs or from a loopback media
       server; streaming or not), a share of them disconnecting mid-stream. Prints requests, failures,
       p50/p99 latency, RSS of the server's processes and /dev/shm bytes of the launch at start and end.
drip:  requests/s of 1-image requests while 0, 2, 8 slow-drip image URLs are in flight.

    python -m benchmarks.serving.soak soak --seconds 600 --clients 10
    python -m benchmarks.serving.soak drip --seconds 30 --drips 0,2,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from tests.media_server import MediaServer
from tests.server.live import LiveServer, data_url, image_message, png_bytes
from workers.engine.models.demo_writer import ensure_demo_model


def rss_mib(root: int) -> float:
    """Resident memory of a process and all its descendants, from /proc."""
    out = subprocess.run(["pgrep", "-g", str(os.getpgid(root))], capture_output=True, text=True).stdout.split()
    total = 0
    for pid in {*out, str(root)}:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def shm_bytes(server: LiveServer) -> int:
    return sum(os.path.getsize(f"/dev/shm/{name}") for name in server.segments() if os.path.exists(f"/dev/shm/{name}"))


def snapshot(server: LiveServer) -> dict[str, float]:
    return {"rss_mib": rss_mib(server.proc.pid), "shm_mib": shm_bytes(server) / 2**20,
            "segments": len(server.segments())}


async def one_request(client: httpx.AsyncClient, server: LiveServer, media: MediaServer, rng: random.Random,
                      images: list[bytes]) -> tuple[str, float]:
    """One mixed request; returns (outcome, seconds). Outcomes: ok, disconnect, failed:<status>."""
    count = rng.choice([0, 1, 1, 2, 3])
    urls = [data_url(rng.choice(images)) if rng.random() < 0.5 else media.url("/img.png") for _ in range(count)]
    body: dict[str, Any] = {"model": "demo", "messages": image_message("Describe.", urls),
                            "max_tokens": rng.choice([4, 16, 32]), "temperature": rng.choice([0, 0.7])}
    stream = rng.random() < 0.5
    disconnect = rng.random() < 0.2
    body["stream"] = stream or disconnect
    started = time.perf_counter()
    try:
        async with client.stream("POST", server.base + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return f"failed:{resp.status_code}", time.perf_counter() - started
            async for _ in resp.aiter_lines():
                if disconnect:
                    return "disconnect", time.perf_counter() - started  # leaving the block closes the socket
    except httpx.HTTPError as exc:
        return f"failed:{type(exc).__name__}", time.perf_counter() - started
    return "ok", time.perf_counter() - started


async def soak(server: LiveServer, media: MediaServer, seconds: float, clients: int) -> dict[str, Any]:
    images = [png_bytes(w, h, seed=i) for i, (w, h) in enumerate([(640, 480), (300, 200), (1280, 720), (96, 96)])]
    outcomes: dict[str, int] = {}
    latencies: list[float] = []
    deadline = time.monotonic() + seconds

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(timeout=120) as client:
            while time.monotonic() < deadline:
                outcome, took = await one_request(client, server, media, rng, images)
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                if outcome == "ok":
                    latencies.append(took)

    await asyncio.gather(*(worker(i) for i in range(clients)))
    latencies.sort()
    return {"outcomes": outcomes, "requests": sum(outcomes.values()),
            "p50_s": latencies[len(latencies) // 2] if latencies else 0.0,
            "p99_s": latencies[int(len(latencies) * 0.99)] if latencies else 0.0}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["soak", "drip"])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--drips", default="0,2,8")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = args.model or ensure_demo_model()
    media = MediaServer(png_bytes(800, 600, seed=9))
    server = LiveServer(model, "--allow-private-media-addresses", "127.0.0.1", "--media-timeout", "5")
    try:
        result: dict[str, Any] = {"mode": args.mode, "cores": os.cpu_count()}
        if args.mode == "soak":
            result["start"] = snapshot(server)
            result |= asyncio.run(soak(server, media, args.seconds, args.clients))
            time.sleep(2)  # let aborted requests finish releasing
            result["end"] = snapshot(server)
            stats = server.stats()
            result["server"] = {k: stats.get(k) for k in ("requests", "shm")}
        else:
            result["req_per_s"] = {n: asyncio.run(drip(server, media, args.seconds, int(n)))
                                   for n in args.drips.split(",")}
        healthy = httpx.get(server.base + "/health", timeout=5).status_code
        result["healthy_after"] = healthy == 200
    finally:
        result["exit"] = server.stop()
        result["segments_left"] = len(server.segments())
        media.close()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
