"""A request body's trip into the HTTP server: uvicorn on uvloop with its own httptools protocol, which stops reading
a socket once 64 KB of body waits for the app, against the same protocol with that mark raised to 32 MB (reading
never pauses for a chat body). The app reads the body the way glimpse's handler does (server/app.py `_read_body`) and
answers with how long that took; the client is httpx, as the openai client and glimpse's bench send. Prints, per
body size and protocol, the client's time from send to answer and the handler's read time (p50 and p90).

Measured (session 22): on the 2-core box the 32 MB mark read a 7.7 MB body ~2-5 ms faster, but on the H200 host
(16 cores) it was ~2x slower at 6.7-20 MB (the app then takes the body in few large, growing chunks), so glimpse
keeps uvicorn's 64 KB.

    python -m benchmarks.serving.http_body_bench --mb 0.8,7.7,20 --count 40
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import time
from typing import Any

import httpx
import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

NO_PAUSE_MARK = 32 << 20


class NoPause(HttpToolsProtocol):
    """uvicorn's protocol with its 64 KB body mark at NO_PAUSE_MARK."""

    def on_body(self, body: bytes) -> None:
        if (self.parser.should_upgrade() and self._should_upgrade()) or self.cycle.response_complete:
            return
        self.cycle.body += body
        if len(self.cycle.body) > NO_PAUSE_MARK:
            self.flow.pause_reading()
        self.cycle.message_event.set()


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    start = time.monotonic()
    chunks: list[bytes] = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(chunks)
    answer = f"{(time.monotonic() - start) * 1e3:.3f} {len(chunks)} {len(body)}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


def _serve(sock: socket.socket, no_pause: bool) -> None:
    http: Any = NoPause if no_pause else "httptools"
    uvicorn.Server(uvicorn.Config(_app, http=http, log_level="warning", lifespan="off")).run(sockets=[sock])


async def _client(url: str, sizes: list[int], count: int) -> dict[int, tuple[list[float], list[float]]]:
    out: dict[int, tuple[list[float], list[float]]] = {}
    async with httpx.AsyncClient(timeout=60) as client:
        for size in sizes:
            body = os.urandom(size)  # bytes, not JSON: the server only moves them
            total, read = [], []
            for i in range(count + 3):
                start = time.monotonic()
                r = await client.post(url, content=body, headers={"content-type": "application/json"})
                elapsed = (time.monotonic() - start) * 1e3
                handler_ms, _, got = r.text.split()
                assert int(got) == size, (got, size)
                if i >= 3:  # the first ones warm the connection and the heap
                    total.append(elapsed)
                    read.append(float(handler_ms))
                await asyncio.sleep(0.02)
            out[size] = (total, read)
    return out


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", default="0.8,7.7,20", help="body sizes in MB, comma-separated")
    ap.add_argument("--count", type=int, default=40, help="requests per size and protocol")
    args = ap.parse_args()
    sizes = [int(float(mb) * 1e6) for mb in args.mb.split(",")]
    rows = []
    for no_pause in (False, True):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        server = mp.get_context("spawn").Process(target=_serve, args=(sock, no_pause), daemon=True)
        server.start()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
        for _ in range(100):
            try:
                httpx.post(url, content=b"{}", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        try:
            result = uvloop.run(_client(url, sizes, args.count))
        finally:
            server.kill()
            sock.close()
        for size, (total, read) in result.items():
            rows.append((size, "no pause" if no_pause else "uvicorn", total, read))
    print(f"{'body MB':>8} {'protocol':>9} {'client p50':>11} {'p90':>7} {'read p50':>9} {'p90':>7}")
    for size, name, total, read in sorted(rows, key=lambda r: (r[0], r[1] != "uvicorn")):
        print(f"{size / 1e6:>8.1f} {name:>9} {statistics.median(total):>11.2f} {_pct(total, 0.9):>7.2f} "
              f"{statistics.median(read):>9.2f} {_pct(read, 0.9):>7.2f}")


if __name__ == "__main__":
    main()
