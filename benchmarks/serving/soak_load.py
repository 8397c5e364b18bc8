"""The soak's clients: N loops of mixed requests against one server, bounded by a deadline and a request cap.

Each request draws, from its client's seeded RNG: chat (1-3 images or none; images fresh, i.e. bytes no request
sent before, or repeated from a small pool; as data: URLs or from the loopback media server) or a plain
completion; streamed or not; and a share of streamed ones is abandoned after the first event (a client
disconnect mid-stream). Only loopback URLs are ever sent.
"""

from __future__ import annotations

import asyncio
import io
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from PIL import Image

from tests.server.live import data_url, image_message, png_bytes


@dataclass
class Mix:
    """Shares of each kind of request (probabilities, each drawn independently)."""

    completion: float = 0.1  # /v1/completions instead of chat
    fresh: float = 0.4  # an image is new bytes (a miss in every cache) rather than one of the pool
    media_url: float = 0.3  # an image comes by http URL from the media server rather than a data: URL
    stream: float = 0.5
    disconnect: float = 0.15  # streamed and abandoned after the first event
    images: tuple[int, ...] = (0, 1, 1, 1, 2, 3)  # images per chat request, drawn uniformly
    max_tokens: tuple[int, ...] = (4, 16, 32, 64)


@dataclass
class LoadResult:
    outcomes: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())

    @property
    def failures(self) -> int:
        return sum(n for k, n in self.outcomes.items() if k.startswith("failed"))

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {"requests": self.requests, "ok": self.outcomes["ok"], "disconnects": self.outcomes["disconnect"],
                "cut": self.outcomes["cut"],
                "failures": self.failures, "outcomes": dict(self.outcomes), "kinds": dict(self.kinds),
                "p50_s": round(lat[len(lat) // 2], 3) if lat else 0.0,
                "p99_s": round(lat[int(len(lat) * 0.99)], 3) if lat else 0.0}


def fresh_png(rng: random.Random) -> bytes:
    """A small image no request has sent before: random size (so the allocators see varied shapes), noise."""
    w, h = rng.randrange(64, 640, 8), rng.randrange(64, 480, 8)
    pixels = np.random.default_rng(rng.getrandbits(63)).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)  # fast: the client shares the cores
    return buf.getvalue()


class Load:
    """The clients' shared set-up: server address, repeated-image pool, media-server URL, limits."""

    def __init__(self, base: str, model: str, media_url: str | None, mix: Mix | None = None,
                 headers: dict[str, str] | None = None, timeout_s: float = 120.0) -> None:
        self.base, self.model, self.media_url = base, model, media_url
        self.mix = mix or Mix()
        self.headers = headers or {}
        self.timeout_s = timeout_s
        sizes = [(640, 480), (300, 200), (1280, 720), (96, 96), (448, 448)]
        self.pool = [png_bytes(w, h, seed=100 + i) for i, (w, h) in enumerate(sizes)]
        self.result = LoadResult()

    async def _image_url(self, rng: random.Random) -> str:
        if self.media_url is not None and rng.random() < self.mix.media_url:
            return self.media_url  # always the same bytes: a repeated image fetched by the tokenizer
        if rng.random() < self.mix.fresh:
            return data_url(await asyncio.to_thread(fresh_png, random.Random(rng.getrandbits(63))))
        return data_url(rng.choice(self.pool))

    async def body(self, rng: random.Random) -> tuple[str, dict[str, Any], bool]:
        """(path, JSON body, abandon after the first event) of one request."""
        mix = self.mix
        stream = rng.random() < mix.stream
        disconnect = stream and rng.random() < mix.disconnect / max(mix.stream, 1e-9)
        sampling: dict[str, Any] = {"model": self.model, "max_tokens": rng.choice(mix.max_tokens),
                                    "temperature": rng.choice([0.0, 0.7]), "stream": stream}
        if rng.random() < mix.completion:
            self.result.kinds["completion"] += 1
            return "/v1/completions", {**sampling, "prompt": f"Count to {rng.randrange(100)}:"}, disconnect
        count = rng.choice(mix.images)
        urls = [await self._image_url(rng) for _ in range(count)]
        self.result.kinds[f"chat_{count}img"] += 1
        body = {**sampling, "messages": image_message(f"Describe {rng.randrange(1000)}.", urls)}
        return "/v1/chat/completions", body, disconnect

    async def one(self, client: httpx.AsyncClient, rng: random.Random) -> str:
        """Send one request; its outcome: ok, disconnect, failed:<status or error>."""
        path, body, disconnect = await self.body(rng)
        started = time.perf_counter()
        try:
            async with client.stream("POST", self.base + path, json=body, headers=self.headers) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return f"failed:{resp.status_code}"
                async for line in resp.aiter_lines():
                    if disconnect and line.startswith("data:"):
                        return "disconnect"  # leaving the block closes the connection mid-stream
                    if line.startswith("data:") and '"error"' in line:
                        return "failed:stream_error"
        except httpx.HTTPError as exc:
            return f"failed:{type(exc).__name__}"
        self.result.latencies.append(time.perf_counter() - started)
        return "ok"

    async def run(self, clients: int, seconds: float, max_requests: int, seed: int = 0,
                  grace_s: float | None = None) -> LoadResult:
        """``clients`` loops until ``seconds`` have passed or ``max_requests`` were sent, whichever comes first.
        A request still running ``grace_s`` after that (default: the request timeout) is abandoned and counted as
        ``cut``, neither ok nor failed: it bounds a run's wall time on a slow machine."""
        deadline = time.monotonic() + seconds
        hard_stop = deadline + (self.timeout_s if grace_s is None else grace_s)
        sent = 0

        async def loop(index: int) -> None:
            nonlocal sent
            rng = random.Random(seed * 1000 + index)
            # One connection per client, as the soak had; a disconnect costs it a new one.
            async with httpx.AsyncClient(timeout=self.timeout_s, limits=httpx.Limits(max_connections=1)) as client:
                while time.monotonic() < deadline and sent < max_requests:
                    sent += 1
                    try:
                        outcome = await asyncio.wait_for(self.one(client, rng), hard_stop - time.monotonic())
                    except TimeoutError:
                        outcome = "cut"
                    self.result.outcomes[outcome] += 1

        await asyncio.gather(*(loop(i) for i in range(clients)))
        return self.result
