"""The HTTP frontend over real HTTP (uvicorn, uvloop by default) and real ZMQ: the test plays the
tokenizer and scheduler ends of the sockets (tests/server/harness.py); the client is the official
`openai` package, or raw httpx where the wire bytes matter."""

from __future__ import annotations

import importlib.metadata
import json
import time
from typing import Any

import httpx
import openai
import pytest

from ipc.control import RequestFailed
from ipc.stats import SchedulerStats, TokenizerStats
from tests.server.harness import API_KEY, LOOPS, MESSAGES, Served, ServeFactory, wait_for


def test_non_streaming_completion(srv: Served) -> None:
    fut = srv.bg(srv.client.chat.completions.create, model="demo", messages=MESSAGES)
    req = srv.peers.request()
    assert req.rid.startswith("chatcmpl-") and json.loads(bytes(req.body))["messages"] == MESSAGES
    srv.peers.accept(req)
    srv.peers.hello(req.rid)
    completion = fut.result(10)
    assert completion.id == req.rid and completion.object == "chat.completion" and completion.model == "demo"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == "Hello"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (5, 2, 7)
    stats = srv.stats()["requests"]
    assert (stats["total"], stats["ok"], stats["in_flight_http"]) == (1, 1, 0)


@LOOPS
def test_streaming_with_usage(serve: ServeFactory, loop: str) -> None:
    srv = serve(loop=loop)
    def consume() -> list[Any]:
        stream = srv.client.chat.completions.create(
            model="demo", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        return list(stream)

    fut = srv.bg(consume)
    req = srv.peers.request()
    srv.peers.accept(req)
    srv.peers.hello(req.rid)
    chunks = fut.result(10)
    assert all(c.id == req.rid and c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    *body, finish, usage = chunks
    assert "".join(c.choices[0].delta.content or "" for c in body) == "Hello"
    assert all(c.choices[0].finish_reason is None for c in body)
    assert finish.choices[0].finish_reason == "stop" and finish.usage is None
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens, usage.usage.total_tokens) == (5, 2, 7)


def test_a_stream_opens_with_its_first_output(srv: Served) -> None:
    """The role chunk goes out with the first token, as vLLM sends it: vLLM's bench client times the first chunk
    with choices as the first token, so one sent before the prefill would read as a TTFT of ~0 and a prefill-long
    inter-token gap."""
    payload = {"model": "demo", "messages": MESSAGES, "stream": True}
    arrivals: list[tuple[float, bytes]] = []

    def consume() -> int:
        headers = {"authorization": f"Bearer {API_KEY}"}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=payload, headers=headers, timeout=10) as resp:
            for chunk in resp.iter_raw():
                arrivals.append((time.monotonic(), chunk))
            return resp.status_code

    fut = srv.bg(consume)
    req = srv.peers.request()
    srv.peers.accept(req)
    time.sleep(0.5)  # the prefill
    first_output = time.monotonic()
    srv.peers.hello(req.rid)
    assert fut.result(10) == 200
    assert arrivals and arrivals[0][0] >= first_output  # not a byte of the body before the first output
    first = json.loads(b"".join(c for _, c in arrivals).split(b"\n\n")[0].removeprefix(b"data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_outputs_before_accepted_are_kept_and_sse_framing(srv: Served) -> None:
    payload = {"model": "demo", "messages": MESSAGES, "stream": True}
    fut = srv.bg(srv.http.post, "/v1/chat/completions", json=payload)
    req = srv.peers.request()
    srv.peers.hello(req.rid)  # overtakes the tokenizer's RequestAccepted (different pipes)
    time.sleep(0.1)
    srv.peers.accept(req)
    response = fut.result(10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and "usage" not in chunks[-1]


@pytest.mark.parametrize("pad", [0, 200_000], ids=["small", "own-frame"])
def test_body_reaches_tokenizer_byte_identical(srv: Served, pad: int) -> None:
    # Odd spacing, key order, escapes and number formats: any re-serialization would change them. A body past
    # ZERO_COPY_BYTES travels as a ZeroMQ frame of its own (ipc/channels.py) and must arrive the same.
    raw = b'{  "messages":[{"content":"h\\u00e9\\n","role":"user"}], "model" :"demo","temperature":1.50,"x":[1e3]'
    raw += b', "pad": "' + b"p" * pad + b'"}\n'
    fut = srv.bg(srv.http.post, "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    req = srv.peers.request()
    assert req.body == raw
    assert abs(req.arrival - time.time()) < 5
    srv.peers.out.send(RequestFailed(req.rid, 400, "nope"))
    assert fut.result(10).status_code == 400


def test_request_failed_surfaces_as_bad_request(srv: Served) -> None:
    fut = srv.bg(srv.client.chat.completions.create, model="demo", messages=MESSAGES)
    req = srv.peers.request()
    srv.peers.out.send(RequestFailed(req.rid, 400, "image 1 is not an image", param="messages", code="invalid_image"))
    with pytest.raises(openai.BadRequestError) as info:
        fut.result(10)
    err = info.value
    assert err.status_code == 400 and "image 1 is not an image" in err.message
    assert (err.param, err.code, err.type) == ("messages", "invalid_image", "invalid_request_error")
    assert srv.stats()["requests"]["failed"] == 1


def test_api_key(srv: Served) -> None:
    bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.code == "invalid_api_key"
    for path in ["/v1/models", "/admin/stats", "/v1/chat/completions", "/tokenize", "/detokenize", "/tokenizer_info"]:
        response = httpx.request("POST" if "chat" in path or path.endswith("tokenize") else "GET", srv.url + path)
        assert response.status_code == 401
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(srv.url + "/metrics").status_code == 200
    # vLLM's /version, open like its other probes: the installed package's version.
    assert httpx.get(srv.url + "/version").json() == {"version": importlib.metadata.version("glimpse"), "server": "glimpse"}
    # Anthropic's clients send the key as x-api-key: a wrong one is refused like a wrong bearer token.
    assert httpx.get(srv.url + "/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
    assert httpx.post(srv.url + "/v1/messages", headers={"x-api-key": "wrong"}).status_code == 401
    assert httpx.get(srv.url + "/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    assert srv.peers.toks[0].recv(100) is None  # nothing unauthenticated reached a tokenizer


def test_a_checkout_without_an_install_still_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from a checkout's root (PYTHONPATH, as on a GPU host that cannot pip install) there is no distribution
    metadata: the server must start anyway, with a version that says so."""
    from server import app

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert app._version() == "0+checkout"


def test_unknown_route_and_wrong_method(srv: Served) -> None:
    response = srv.http.get("/v1/nope")
    assert response.status_code == 404
    assert response.json() == {
        "error": {"message": "Invalid URL (GET /v1/nope)", "type": "invalid_request_error", "param": None, "code": "not_found"}
    }
    response = srv.http.get("/v1/chat/completions")
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in response.headers["allow"]
    with pytest.raises(openai.NotFoundError):
        srv.client.embeddings.create(model="demo", input="x")


def test_models(srv: Served) -> None:
    models = srv.client.models.list()
    assert [m.id for m in models.data] == ["demo"] and models.data[0].object == "model"
    assert srv.http.get("/v1/models").json()["object"] == "list"


def test_admin_stats_and_metrics(serve: ServeFactory) -> None:
    srv = serve(tokenizer_workers=2)
    base: dict[str, int] = {f: 0 for f in SchedulerStats.__struct_fields__ if f not in ("workers", "encoders")}
    base |= {"requests_running": 2, "requests_waiting": 3, "kv_blocks_used": 10, "kv_blocks_total": 100}
    base |= {"mm_cache_entries": 4, "mm_cache_bytes": 4096, "mm_cache_hits": 3, "mm_cache_misses": 1}
    base |= {"images_encoded": 1, "vit_batches": 1, "shm_segments": 2, "shm_bytes": 2048, "shm_budget_bytes": 1 << 30}
    base |= {"shm_landing_segments": 1, "shm_landing_bytes": 512}  # --encoder-workers: part of shm_bytes
    base |= {"mm_host_cache_budget_bytes": 1 << 20, "mm_host_cache_bytes": 3072, "mm_host_cache_entries": 1,
             "mm_host_cache_hits": 2, "mm_host_cache_spills": 4, "mm_host_cache_reloads": 2}
    base |= {"kv_host_cache_slots_total": 64, "kv_host_cache_slots_used": 9, "kv_host_cache_spilled_blocks": 12,
             "kv_host_cache_loaded_blocks": 3, "kv_host_cache_hit_tokens": 48}
    srv.peers.out.send(SchedulerStats(**base))
    time.sleep(0.2)
    srv.peers.out.send(SchedulerStats(**(base | {"generated_tokens": 50})))
    srv.peers.out.send(TokenizerStats(worker=1, queue_depth=2, requests=9, images=6, images_reused=4))
    wait_for(lambda: srv.stats()["tokenizers"][1]["requests"] == 9, what="stats")
    stats = srv.stats()
    assert stats["status"] == "ok"
    assert stats["requests"] == {"running": 2, "waiting": 3, "in_flight_http": 0, "total": 0, "ok": 0, "failed": 0, "aborted": 0}
    assert 50 / 0.5 < stats["tokens_per_s"] < 50 / 0.19
    assert stats["kv_blocks"] == {"used": 10, "total": 100}
    assert stats["mm_cache"] == {"entries": 4, "bytes": 4096, "hits": 3, "misses": 1, "evictions": 0, "hit_rate": 0.75}
    assert (stats["images_encoded"], stats["vit_batches"]) == (1, 1)
    assert stats["mm_host_cache"] == {"budget_bytes": 1 << 20, "bytes": 3072, "entries": 1, "hits": 2, "spills": 4,
                                      "reloads": 2, "evictions": 0}
    assert stats["kv_host_cache"] == {"slots_total": 64, "slots_used": 9, "spilled_blocks": 12, "loaded_blocks": 3,
                                      "hit_tokens": 48}
    assert stats["shm"] == {"segments": 2, "bytes": 2048, "budget_bytes": 1 << 30, "retained_segments": 0, "retained_bytes": 0,
                            "landing_segments": 1, "landing_bytes": 512}
    assert stats["tokenizers"] == [
        {"worker": 0, "queue_depth": 0, "outstanding": 0, "requests": 0, "images": 0, "images_reused": 0, "images_deferred": 0, "videos": 0, "videos_decoded": 0, "video_frames_decoded": 0, "video_groups_reused": 0},
        {"worker": 1, "queue_depth": 2, "outstanding": 0, "requests": 9, "images": 6, "images_reused": 4, "images_deferred": 0, "videos": 0, "videos_decoded": 0, "video_frames_decoded": 0, "video_groups_reused": 0},
    ]
    text = srv.http.get("/metrics").text
    for line in [
        "glimpse_requests_running 2.0",
        "glimpse_kv_blocks_total 100.0",
        "glimpse_mm_cache_hits_total 3.0",
        "glimpse_mm_host_cache_reloads_total 2.0",
        "glimpse_mm_host_cache_budget_bytes 1.048576e+06",
        "glimpse_kv_host_cache_slots_total 64.0",
        "glimpse_kv_host_cache_slots_used 9.0",
        "glimpse_kv_host_cache_spilled_blocks_total 12.0",
        "glimpse_kv_host_cache_loaded_blocks_total 3.0",
        "glimpse_kv_host_cache_hit_tokens_total 48.0",
        "glimpse_generated_tokens_total 50.0",
        "glimpse_shm_landing_bytes 512.0",
        'glimpse_tokenizer_images_reused_total{worker="1"} 4.0',
        'glimpse_tokenizer_outstanding{worker="0"} 0.0',
        "glimpse_requests_total 0.0",
        "glimpse_tokens_per_second",
        "glimpse_time_to_first_token_seconds_bucket",
    ]:
        assert line in text, line


def test_least_outstanding_tokenizer(serve: ServeFactory) -> None:
    srv = serve(tokenizer_workers=2)
    first = srv.bg(srv.http.post, "/v1/chat/completions", content=b"{}")
    second = srv.bg(srv.http.post, "/v1/chat/completions", content=b"{}")
    reqs = [srv.peers.request(0), srv.peers.request(1)]  # one each: the other was busy
    assert [t["outstanding"] for t in srv.stats()["tokenizers"]] == [1, 1]
    for req in reqs:
        srv.peers.out.send(RequestFailed(req.rid, 400, "empty"))
    assert first.result(10).status_code == second.result(10).status_code == 400
