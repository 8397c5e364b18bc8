"""End to end: `glimpse serve` on the demo model in real processes, driven by the official openai client."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from ipc.prompts import SamplingParams
from tests.server.live import LiveServer, data_url, image_message, png_bytes
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine

# The loopback media server is a private address: allowed here explicitly, as an operator would.
LIMITS = ("--max-image-pixels", "300000", "--max-image-mb", "0.5", "--max-images-per-request", "6",
          "--max-model-len", "2048", "--tokenizer-workers", "2", "--allow-private-media-addresses", "127.0.0.1",
          "--mm-host-cache-mb", "1", "--kv-host-cache-mb", "1")
IMAGES = [png_bytes(300, 200, seed=1), png_bytes(123, 77, seed=2), png_bytes(64, 250, seed=3)]


@pytest.fixture(scope="module")
def live(demo_model_dir: Path) -> Iterator[LiveServer]:
    server = LiveServer(demo_model_dir, *LIMITS)
    yield server
    code = server.stop()
    assert code == 0, server.output()
    assert server.segments() == []


@pytest.fixture(scope="module")
def offline(demo_model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(demo_model_dir), num_kv_blocks=512))


def offline_text(engine: Engine, text: str, images: list[bytes], max_tokens: int) -> tuple[str, int]:
    parts: list[dict[str, Any]] = [{"type": "image", "image": Image.open(io.BytesIO(b)).convert("RGB")} for b in images]
    parts.append({"type": "text", "text": text})
    [out] = engine.generate([[{"role": "user", "content": parts}]], SamplingParams(max_tokens=max_tokens, temperature=0))
    return out.text, len(out.token_ids)


def test_non_streaming_text_equals_offline_engine(live: LiveServer, offline: Engine) -> None:
    resp = live.client().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "What does the chart show?"}], max_tokens=12, temperature=0
    )
    text, n = offline_text(offline, "What does the chart show?", [], 12)
    assert resp.choices[0].message.content == text
    assert resp.usage is not None and resp.usage.completion_tokens == n
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_streaming_multi_image_equals_offline_engine(live: LiveServer, offline: Engine) -> None:
    stream = live.client().chat.completions.create(
        model="demo", messages=image_message("Compare the pages.", [data_url(b) for b in IMAGES]),  # type: ignore[arg-type]
        max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    text, n = offline_text(offline, "Compare the pages.", IMAGES, 16)
    assert "".join(pieces) == text
    assert usage is not None and usage.completion_tokens == n and usage.prompt_tokens > 3 * 4
    assert finish in ("stop", "length")


def test_both_tokenizer_workers_are_used(live: LiveServer) -> None:
    client = live.client()
    for i in range(4):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=2)
    workers = live.stats()["tokenizers"]
    assert len(workers) == 2 and all(w["requests"] > 0 for w in workers)


def test_every_serving_process_froze_its_start_up_heap(live: LiveServer) -> None:
    """The frontend, the model worker and the scheduler report the objects they moved out of the collector's reach
    before they got ready (torch, the model, the tokenizer: far more than 10,000) and their collections since; their
    full collections run once they are idle (workers/common/full_collections.py), not between steps."""
    client = live.client()
    for i in range(3):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=4)

    def rows() -> list[dict[str, Any]]:
        stats = live.stats()
        return [stats["frontend_gc"], stats["scheduler_gc"]] + [w["gc"] for w in stats["model_workers"]]

    assert len(rows()) == 3
    deadline = time.monotonic() + 30
    while any(row["idle_full_collections"] == 0 for row in rows()) and time.monotonic() < deadline:
        time.sleep(0.2)  # GC_IDLE_S after the last step, and the next stats report
    for row in rows():
        assert row["frozen_objects"] > 10_000
        assert row["idle_full_collections"] >= 1
        assert row["full_collections"] == 0  # none on the serving path: the oldest generation waits for idle time
        assert row["collections"] >= 0 and row["pause_ms_sum"] >= row["pause_ms_max"] >= 0.0


def test_repeated_images_hit_the_cache_and_are_not_encoded_again(live: LiveServer) -> None:
    client = live.client()
    first = [data_url(png_bytes(200, 140, seed=40)), data_url(png_bytes(90, 180, seed=41))]
    client.chat.completions.create(model="demo", messages=image_message("Read.", first), max_tokens=4)  # type: ignore[arg-type]
    before = live.stats()
    second = image_message("Read.", first) + [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png_bytes(80, 80, seed=42))}}]},
    ]
    client.chat.completions.create(model="demo", messages=second, max_tokens=4)  # type: ignore[arg-type]
    after = live.stats()
    assert after["images_encoded"] - before["images_encoded"] == 1  # only the new image
    assert after["mm_host_cache"]["budget_bytes"] == 1 << 20  # the host tier, sized by --mm-host-cache-mb
    # The prefix cache's host tier: as many KV blocks as --kv-host-cache-mb holds, in the scheduler's index too.
    assert after["kv_host_cache"]["slots_total"] > 0 and after["kv_host_cache"]["loaded_blocks"] == 0
    # The first turn's segments were kept alive: the second turn's tokenizer linked them instead of
    # decoding, processing and writing the pixels again.
    reused = sum(w["images_reused"] for w in after["tokenizers"]) - sum(w["images_reused"] for w in before["tokenizers"])
    assert reused == 2
    # The first turn's images are covered either by its KV blocks (prefix cache: nothing to embed) or
    # by the embedding cache; either way nothing but the new image reached the ViT.
    hits = after["mm_cache"]["hits"] - before["mm_cache"]["hits"]
    reused_tokens = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    assert hits >= 2 or reused_tokens >= 2 * (200 // 28) * (140 // 28)


BAD_INPUTS: list[tuple[str, Any, int, str | None]] = [
    ("malformed json", b'{"model": "demo", "messages": [', 400, "invalid_json"),
    ("wrong type", {"model": "demo", "messages": "hello"}, 400, "invalid_value"),
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found"),
    ("bad base64", {"image": "data:image/png;base64,@@@not-base64@@@"}, 400, "invalid_base64"),
    ("non-ascii base64", {"image": "data:image/png;base64,iVBOR\u00e9\u2603w0KGgo="}, 400, "invalid_base64"),
    ("not an image", {"image": data_url(b"these bytes are not a picture" * 10)}, 400, "invalid_image"),
    ("too many pixels", {"image": "big"}, 400, "image_too_large"),
    ("too many bytes", {"image": data_url(png_bytes(500, 400, seed=5))}, 400, "image_too_large"),
    ("too many images", {"images": 7}, 400, "too_many_images"),
    ("prompt too long", {"model": "demo", "messages": [{"role": "user", "content": "page " * 3000}]}, 400,
     "context_length_exceeded"),
    ("temperature", {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400,
     "invalid_value"),
    ("top_p", {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "invalid_value"),
    ("max_tokens", {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
     "invalid_value"),
]


def _bad_body(spec: Any) -> bytes:
    if isinstance(spec, bytes):
        return spec
    if "image" in spec:
        url = spec["image"]
        if url == "big":  # 700 x 500 = 350k pixels, over the 300k cap, yet a tiny PNG
            buf = io.BytesIO()
            Image.new("RGB", (700, 500), (10, 20, 30)).save(buf, format="PNG")
            url = data_url(buf.getvalue())
        return json.dumps({"model": "demo", "messages": image_message("x", [url])}).encode()
    if "images" in spec:
        urls = [data_url(png_bytes(30, 30, seed=i)) for i in range(spec["images"])]
        return json.dumps({"model": "demo", "messages": image_message("x", urls)}).encode()
    return json.dumps(spec).encode()


@pytest.mark.parametrize(("case", "spec", "status", "code"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_its_own_4xx(live: LiveServer, case: str, spec: Any, status: int, code: str | None) -> None:
    r = httpx.post(live.base + "/v1/chat/completions", content=_bad_body(spec),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == code
    # The server keeps serving.
    assert httpx.get(live.base + "/health").status_code == 200
    ok = live.client().chat.completions.create(model="demo", messages=[{"role": "user", "content": "ok?"}], max_tokens=1)
    assert ok.choices[0].finish_reason == "length"


def test_image_from_http_url_on_loopback(live: LiveServer, offline: Engine) -> None:
    raw = png_bytes(150, 100, seed=77)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/page.png"
        resp = live.client().chat.completions.create(
            model="demo", messages=image_message("What is it?", [url]), max_tokens=8, temperature=0  # type: ignore[arg-type]
        )
    finally:
        httpd.shutdown()
    assert resp.choices[0].message.content == offline_text(offline, "What is it?", [raw], 8)[0]


def _wait_idle(live: LiveServer, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    stats = live.stats()
    while time.monotonic() < deadline:
        stats = live.stats()
        shm = stats["shm"]
        # Only images kept for reuse by later turns may stay in shm; every request's own names are gone.
        if stats["requests"]["running"] == 0 and stats["kv_blocks"]["used"] == 0 and shm["segments"] == shm[
            "retained_segments"
        ]:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"resources not freed: {stats}")


def test_client_disconnect_frees_kv_blocks_and_shm(live: LiveServer) -> None:
    with httpx.stream("POST", live.base + "/v1/chat/completions", timeout=30, json={
        "model": "demo", "stream": True, "max_tokens": 4000, "ignore_eos": True,
        "messages": image_message("Go on forever.", [data_url(png_bytes(200, 200, seed=9))]),
    }) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        while live.stats()["kv_blocks"]["used"] == 0:
            time.sleep(0.05)
    stats = _wait_idle(live)
    assert stats["requests"]["in_flight_http"] == 0
    assert len(live.segments()) == stats["shm"]["retained_segments"]


def test_corrupt_third_image_is_a_clean_400_after_prefill_started(live: LiveServer, offline: Engine) -> None:
    """Overlap of preprocessing and prefill: the prompt reaches the scheduler once the three headers are read,
    and the third image's pixels turn out truncated only when decoded. The streaming client still gets a 400
    naming that image (the answer is held back until every image is written), nothing is left in shm but
    images kept for reuse, and the same server answers the two good images exactly."""
    good = [png_bytes(220, 160, seed=61), png_bytes(140, 210, seed=62)]
    whole = png_bytes(400, 300, seed=63)
    before = sum(w["images_deferred"] for w in live.stats()["tokenizers"])
    with pytest.raises(openai.BadRequestError) as err:
        live.client().chat.completions.create(
            model="demo", messages=image_message("Compare.", [data_url(b) for b in [*good, whole[: len(whole) // 2]]]),  # type: ignore[arg-type]
            max_tokens=8, temperature=0, stream=True,
        )
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "invalid_image", body
    assert body["param"] == "messages[0].content[2].image_url"
    # Stats arrive every 0.25 s and may predate the failure: wait for the scheduler's account to hold the two
    # written images (kept for reuse) and for /dev/shm to hold exactly those.
    deadline = time.monotonic() + 10
    while True:
        stats = _wait_idle(live)
        if len(live.segments()) == stats["shm"]["retained_segments"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(live.segments()) == stats["shm"]["retained_segments"], (live.segments(), stats["shm"])
    # All three: the request has its tokenizer to itself, so even the first image is written after the prompt left.
    assert sum(w["images_deferred"] for w in stats["tokenizers"]) - before == 3
    resp = live.client().chat.completions.create(
        model="demo", messages=image_message("Compare.", [data_url(b) for b in good]), max_tokens=8, temperature=0,  # type: ignore[arg-type]
    )
    assert resp.choices[0].message.content == offline_text(offline, "Compare.", good, 8)[0]


def test_32_concurrent_requests_all_succeed(live: LiveServer) -> None:
    client = live.client(timeout=120)

    def one(i: int) -> str | None:
        messages = image_message(f"Page {i}?", [data_url(png_bytes(60 + i, 40 + i, seed=i))]) if i % 2 else [
            {"role": "user", "content": f"Question {i}"}]
        resp = client.chat.completions.create(model="demo", messages=messages, max_tokens=8)  # type: ignore[arg-type]
        return resp.choices[0].finish_reason

    with ThreadPoolExecutor(32) as pool:
        reasons = list(pool.map(one, range(32)))
    assert all(r in ("stop", "length") for r in reasons)
    _wait_idle(live)


def test_killing_the_model_worker_fails_in_flight_requests_fast(demo_model_dir: Path) -> None:
    server = LiveServer(demo_model_dir, "--tokenizer-workers", "1")
    try:
        [model_pid] = server.child_pids("model")
        client = server.client(timeout=30)
        stream = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Keep going."}], max_tokens=5000, stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        os.kill(model_pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in stream:
                pass
        assert time.monotonic() - killed < 1.5
        code = server.proc.wait(30)
        assert code != 0
    finally:
        server.stop(signal.SIGKILL)
    assert server.segments() == []


def test_sigterm_drains_and_notifies_systemd(demo_model_dir: Path) -> None:
    path = Path(tempfile.mkdtemp()) / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(60)
    server = LiveServer(demo_model_dir, "--tokenizer-workers", "1", env={"NOTIFY_SOCKET": str(path)})
    try:
        assert sock.recv(64) == b"READY=1"
        client = server.client(timeout=60)
        stream = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Drain me."}], max_tokens=48, stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(iter(stream))
        server.proc.send_signal(signal.SIGTERM)
        rest = [c for c in stream]
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
        assert first is not None
        assert server.proc.wait(30) == 0, server.output()
        assert sock.recv(64) == b"STOPPING=1"
    finally:
        server.stop(signal.SIGKILL)
        sock.close()
    assert server.segments() == []
