"""How the guarded protocol (server/http_guard.py) reads a request body: a multi-megabyte body is taken off the
socket whole while the app is not reading it yet (uvicorn's own protocol stops at 64 KB, and each stop costs a
loopback TCP window's reopening), and past BODY_HIGH_WATER reading still pauses until the app catches up, with
every byte delivered. Real uvicorn on uvloop, a real socket; the app is a small ASGI callable that waits for the
protocol's verdict before it reads."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
import uvloop

from server import http_guard
from server.http_guard import GuardedProtocol, HttpLimits, guarded_protocol
from tests.server.harness import wait_for

LIMITS = HttpLimits(max_connections=16, header_timeout_s=10.0, idle_timeout_s=10.0, max_header_bytes=16 << 10)


class _Watch:
    """What the protocol did with the one request in flight: set from the protocol's callbacks on the loop."""

    def __init__(self) -> None:
        self.paused = asyncio.Event()  # reading paused with body bytes the app has not taken
        self.complete = asyncio.Event()  # the whole body is off the socket


def _protocol(watch: list[_Watch]) -> type[GuardedProtocol]:
    base: Any = guarded_protocol(LIMITS)

    class Watched(base):
        def on_headers_complete(self) -> None:
            watch.append(_Watch())
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            if self.flow.read_paused:
                watch[-1].paused.set()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            watch[-1].complete.set()

    return Watched


def _app(watch: list[_Watch]) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        current = watch[-1]
        # Read nothing until the protocol has either taken the whole body or paused: the app's reading must not
        # be what drains the socket.
        waits = [asyncio.ensure_future(current.complete.wait()), asyncio.ensure_future(current.paused.wait())]
        await asyncio.wait(waits, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        paused = current.paused.is_set()
        size, more = 0, True
        while more:
            message = await receive()
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        answer = json.dumps({"size": size, "paused": paused}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]})
        await send({"type": "http.response.body", "body": answer})

    return app


@pytest.fixture
def server() -> Iterator[str]:
    watch: list[_Watch] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_app(watch), log_level="warning", http=_protocol(watch), lifespan="off")
    uv = uvicorn.Server(config)

    def run() -> None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(uv.serve(sockets=[sock]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: uv.started, what="uvicorn start")
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    uv.should_exit = True
    thread.join(10)


def _post(address: str, size: int) -> dict[str, Any]:
    host, port = address.split(":")
    body = b"x" * size
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode()
        sock.sendall(head + body)
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {raw!r}"
            raw += chunk
    head_bytes, _, answer = raw.partition(b"\r\n\r\n")
    assert head_bytes.startswith(b"HTTP/1.1 200"), head_bytes
    result: dict[str, Any] = json.loads(answer)
    return result


def test_a_large_body_is_read_whole_while_the_app_waits(server: str) -> None:
    # 6 MB: a chat with a few 1080p images in base64, far past uvicorn's 64 KB pause.
    assert _post(server, 6 << 20) == {"size": 6 << 20, "paused": False}


def test_past_the_high_water_reading_pauses_and_every_byte_still_arrives(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_guard, "BODY_HIGH_WATER", 1 << 20)
    assert _post(server, 6 << 20) == {"size": 6 << 20, "paused": True}
    # Back under the mark, the next body on a new connection is not paused.
    monkeypatch.setattr(http_guard, "BODY_HIGH_WATER", 32 << 20)
    assert _post(server, 3 << 20) == {"size": 3 << 20, "paused": False}
