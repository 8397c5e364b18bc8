"""The HTTP frontend's request lifecycle over real HTTP and real ZMQ (the test plays the tokenizer and scheduler ends,
tests/server/harness.py): a client that goes away is aborted upstream, a failure mid-stream ends the stream in
each API's own error event, a crashed child fails in-flight requests fast, draining refuses new work, and /health
waits for every child."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from ipc.control import ProcessReady, RequestFailed
from tests.server.harness import API_KEY, LOOPS, MESSAGES, Served, ServeFactory, wait_for


@LOOPS
def test_stream_disconnect_sends_abort(serve: ServeFactory, loop: str) -> None:
    srv = serve(loop=loop)
    payload = {"model": "demo", "messages": MESSAGES, "stream": True}
    got_content = threading.Event()

    def read_some() -> None:
        with srv.http.stream("POST", "/v1/chat/completions", json=payload) as response:
            for line in response.iter_lines():
                if '"content":"Hel"' in line:
                    got_content.set()
                    return  # leaving the block closes the connection mid-stream

    fut = srv.bg(read_some)
    req = srv.peers.request()
    srv.peers.accept(req)
    srv.peers.output(req.rid, "Hel", None, 1)
    fut.result(10)
    assert got_content.is_set()
    assert srv.peers.abort().rid == req.rid
    wait_for(lambda: srv.stats()["requests"]["aborted"] == 1, what="abort counted")
    srv.peers.output(req.rid, "lo", "stop", 2)  # late output for a forgotten rid: dropped
    fut2 = srv.bg(srv.client.chat.completions.create, model="demo", messages=MESSAGES)
    req2 = srv.peers.request()
    srv.peers.accept(req2)
    srv.peers.hello(req2.rid)
    assert fut2.result(10).choices[0].message.content == "Hello"


def test_non_stream_disconnect_before_accept_sends_abort(srv: Served) -> None:
    fut = srv.bg(srv.http.post, "/v1/chat/completions", json={"model": "demo", "messages": MESSAGES}, timeout=0.5)
    req = srv.peers.request()
    with pytest.raises(httpx.ReadTimeout):
        fut.result(10)
    # The tokenizer may still hand the request to the scheduler: the abort must reach it anyway.
    assert srv.peers.abort().rid == req.rid
    srv.peers.accept(req)  # late: dropped without harm
    assert srv.http.get("/health").status_code == 200


def test_mid_stream_failure_emits_error_event(srv: Served) -> None:
    def consume() -> list[Any]:
        return list(srv.client.chat.completions.create(model="demo", messages=MESSAGES, stream=True))

    fut = srv.bg(consume)
    req = srv.peers.request()
    srv.peers.accept(req)
    srv.peers.output(req.rid, "Hel", None, 1)
    srv.peers.out.send(RequestFailed(req.rid, 500, "model worker failed", type="server_error"))
    with pytest.raises(openai.APIError) as info:
        fut.result(10)
    assert "model worker failed" in info.value.message and info.value.type == "server_error"
    assert srv.peers.sched.recv(200) is None  # the failing child cleaned up itself: no abort


def test_fail_all_fails_in_flight_fast(srv: Served) -> None:
    plain = srv.bg(srv.client.chat.completions.create, model="demo", messages=MESSAGES)
    streamed = srv.bg(lambda: list(srv.client.chat.completions.create(model="demo", messages=MESSAGES, stream=True)))
    never = [{"role": "user", "content": "never accepted"}]
    waiting = srv.bg(srv.client.chat.completions.create, model="demo", messages=never)
    # The three requests may reach the tokenizer in any order: tell them apart by their bodies.
    reqs = [srv.peers.request() for _ in range(3)]
    accepted = [r for r in reqs if json.loads(bytes(r.body))["messages"] == MESSAGES]
    [stream_req] = [r for r in accepted if json.loads(bytes(r.body)).get("stream")]
    for req in accepted:
        srv.peers.accept(req)
    srv.peers.output(stream_req.rid, "Hel", None, 1)
    time.sleep(0.2)
    assert srv.stats()["requests"]["in_flight_http"] == 3
    t0 = time.monotonic()
    srv.state.fail_all_threadsafe("scheduler died")
    for fut in (plain, waiting):
        with pytest.raises(openai.InternalServerError) as info:
            fut.result(5)
        assert info.value.status_code == 503 and info.value.type == "server_error"
    with pytest.raises(openai.APIError, match="scheduler died"):
        streamed.result(5)
    assert time.monotonic() - t0 < 1.0
    health = srv.http.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    with pytest.raises(openai.InternalServerError, match="scheduler died"):
        srv.client.chat.completions.create(model="demo", messages=MESSAGES)
    assert srv.peers.toks[0].recv(100) is None  # refused before reaching a tokenizer


def test_draining(srv: Served) -> None:
    fut = srv.bg(srv.client.chat.completions.create, model="demo", messages=MESSAGES)
    req = srv.peers.request()
    srv.peers.accept(req)
    drained = srv.on_loop(srv.state.drain(5.0))
    wait_for(lambda: srv.http.get("/health").status_code == 503, what="draining health")
    with pytest.raises(openai.InternalServerError):
        srv.client.chat.completions.create(model="demo", messages=MESSAGES)
    assert not drained.done()
    srv.peers.hello(req.rid)  # the request in flight still completes
    assert fut.result(10).choices[0].message.content == "Hello"
    assert drained.result(5) is True


def test_body_too_large(srv: Served) -> None:
    big = b"x" * ((1 << 20) + 1)
    response = srv.http.post("/v1/chat/completions", content=big)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    # Chunked upload: no Content-Length, caught while reading.
    response = srv.http.post("/v1/chat/completions", content=iter([big[: 1 << 19], big[1 << 19 :]]))
    assert response.status_code == 413
    assert srv.peers.toks[0].recv(100) is None


def test_health_waits_for_every_child(serve: ServeFactory) -> None:
    srv = serve(ready=False, tokenizer_workers=2)
    assert srv.http.get("/health").json()["status"] == "starting"
    srv.peers.out.send(ProcessReady("scheduler", 0, 1))
    srv.peers.out.send(ProcessReady("tokenizer", 0, 1))
    time.sleep(0.1)
    assert srv.http.get("/health").status_code == 503  # tokenizer 1 is still missing
    srv.peers.out.send(ProcessReady("tokenizer", 1, 1))
    wait_for(lambda: srv.http.get("/health").status_code == 200, what="ready")
    assert srv.http.get("/health").json() == {"status": "ok"}
    roles = [srv.on_loop(srv.state.ready_messages.get()).result(1).role for _ in range(3)]
    assert sorted(roles) == ["scheduler", "tokenizer", "tokenizer"]


def test_a_failed_stream_ends_in_each_api_s_own_error_event(srv: Served) -> None:
    """After the status line, a failure travels in the stream as the endpoint's own clients read one: the anthropic
    SDK raises from Anthropic's ``error`` event and the openai SDK's Responses stream stops at ``response.failed``
    (a chat-shaped ``data: {"error": ...}`` is skipped by the first and not a Responses event for the second)."""
    import anthropic

    def fail_after_text(rid: str) -> None:
        srv.peers.output(rid, "Hel", None, 1)
        srv.peers.out.send(RequestFailed(rid, 500, "model worker failed", type="server_error"))

    claude = anthropic.Anthropic(base_url=srv.url, api_key=API_KEY, max_retries=0, timeout=10)

    def messages() -> list[Any]:
        with claude.messages.stream(model="demo", max_tokens=8, messages=MESSAGES) as stream:
            return list(stream)

    fut = srv.bg(messages)
    req = srv.peers.request()
    srv.peers.accept(req, endpoint="messages")
    fail_after_text(req.rid)
    with pytest.raises(anthropic.APIStatusError) as err:
        fut.result(10)
    assert "model worker failed" in str(err.value)
    assert isinstance(err.value.body, dict) and err.value.body["error"]["type"] == "api_error"

    fut = srv.bg(lambda: list(srv.client.responses.create(model="demo", input="hi", stream=True)))
    req = srv.peers.request()
    srv.peers.accept(req, endpoint="responses")
    fail_after_text(req.rid)
    events = fut.result(10)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.failed", kinds
    assert "response.output_text.done" in kinds  # the open message was closed before the failure
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None and failed.error.message == "model worker failed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
