"""The connection guard (server/http_guard.py) on the real HTTP frontend, with the test playing the
children (tests/server/harness.py): at the connection cap idle connections make room and busy ones
do not (the newcomer gets a JSON 503), and a client that stops reading a stream is cut off and its
request aborted instead of filling buffers forever."""

from __future__ import annotations

import json
import socket
import time

import httpx

from server.http_guard import HttpLimits
from tests.server.harness import API_KEY, MESSAGES, ServeFactory, wait_for

CHAT = json.dumps({"model": "demo", "messages": MESSAGES, "stream": True}).encode()


def raw_chat(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(CHAT)}\r\n\r\n".encode() + CHAT
    )
    return sock


def test_cap_evicts_idle_connections_and_refuses_when_all_are_busy(serve: ServeFactory) -> None:
    srv = serve(http_limits=HttpLimits(max_connections=2, header_timeout_s=30, idle_timeout_s=30, max_header_bytes=8192))
    host, port = srv.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(2)]
    time.sleep(0.1)
    # Two idle connections fill the cap: a newcomer is served, the oldest idle one closed for it.
    assert httpx.get(srv.url + "/health").status_code == 200
    idle[0].settimeout(5)
    assert idle[0].recv(1) == b""
    for sock in idle:
        sock.close()
    # Two requests in progress (their tokenizer never answers): nothing to evict, so a JSON 503.
    busy = [raw_chat(srv.url) for _ in range(2)]
    reqs = [srv.peers.request(), srv.peers.request()]
    response = httpx.get(srv.url + "/health")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "too_many_connections"
    for req in reqs:
        srv.peers.accept(req)
        srv.peers.hello(req.rid)
    for sock in busy:
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.close()
    wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, what="room again")


def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(serve: ServeFactory) -> None:
    srv = serve(http_limits=HttpLimits(max_connections=100, header_timeout_s=30, idle_timeout_s=1.0, max_header_bytes=8192))
    sock = raw_chat(srv.url)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    req = srv.peers.request()
    srv.peers.accept(req)
    chunk = "x" * 100_000
    for i in range(400):  # 40 MB of stream the client never reads: far more than the socket buffers hold
        srv.peers.output(req.rid, chunk, None, i + 1)
    start = time.monotonic()
    assert srv.peers.abort(timeout_s=30).rid == req.rid  # the write stall closed it: the scheduler is told
    assert time.monotonic() - start < 25
    sock.close()
