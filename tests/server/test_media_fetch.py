"""Image URLs against the real server: the address guard (every spelling, redirects), one message for
every failed fetch, one deadline while bytes drip, and a slow URL that delays nothing but itself and
is cancelled when its client leaves. One tokenizer, so any head-of-line blocking would show (the
server: `hostile` in conftest.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.media_server import MediaServer
from tests.server.conftest import MEDIA_TIMEOUT_S
from tests.server.live import LiveServer, image_message
from tests.workers.tokenizer.media.test_http_fetch import SPELLINGS
from workers.tokenizer.media.http_fetch import FETCH_FAILED


@pytest.fixture
def live(hostile: LiveServer) -> LiveServer:
    return hostile


@pytest.fixture
def other(other_media: MediaServer) -> MediaServer:
    return other_media


def ask(live: LiveServer, url: str, timeout: float = 30) -> httpx.Response:
    body = {"model": "demo", "messages": image_message("What is it?", [url]), "max_tokens": 2}
    return httpx.post(live.base + "/v1/chat/completions", json=body, timeout=timeout)


def assert_generic_refusal(response: httpx.Response) -> None:
    assert response.status_code == 400, response.text
    assert response.json() == {"error": {
        "message": FETCH_FAILED, "type": "invalid_request_error",
        "param": "messages[0].content[0].image_url", "code": "image_fetch_failed",
    }}


def test_exempt_store_serves_images(live: LiveServer, media: MediaServer) -> None:
    resp = live.client().chat.completions.create(
        model="demo", messages=image_message("What is it?", [media.url("/img.png")]), max_tokens=2  # type: ignore[arg-type]
    )
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert ask(live, media.url(f"/redirect?to={media.url('/img.png')}")).status_code == 200


def test_ssrf_table_is_refused_with_one_message(live: LiveServer, media: MediaServer, other: MediaServer) -> None:
    urls = [f"http://{host}:{other.port}/img.png" for host in SPELLINGS]
    # The exempt port, at another address (127.0.0.1 itself, however spelled, is the exempt store).
    urls += [f"http://{host}:{media.port}/img.png" for host in ("[::1]", "0.0.0.0", "127.0.0.2", "[::]")]
    # Redirects from the exempt store to everything above: every hop is checked again.
    urls += [media.url(f"/redirect?to={u}") for u in urls[:8]]
    # Failures that are not the guard's read the same: a closed port, a 404, too many redirects.
    urls += ["http://127.0.0.1:1/x.png", media.url("/missing"), media.url("/redirect-loop")]
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda u: ask(live, u), urls))
    for url, response in zip(urls, responses):
        assert response.status_code == 400, url
        assert_generic_refusal(response)
    assert sum(other.hits.values()) == 0
    # The official client sees the same.
    with pytest.raises(openai.BadRequestError) as info:
        live.client().chat.completions.create(
            model="demo", messages=image_message("x", [f"http://2130706433:{other.port}/"]), max_tokens=2  # type: ignore[arg-type]
        )
    assert info.value.code == "image_fetch_failed" and FETCH_FAILED in info.value.message


def _text_latency(live: LiveServer) -> float:
    start = time.monotonic()
    httpx.post(live.base + "/v1/chat/completions", timeout=30, json={
        "model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
    }).raise_for_status()
    return time.monotonic() - start


def test_drip_deadline_and_a_text_request_beside_it(live: LiveServer, media: MediaServer) -> None:
    baseline = min(_text_latency(live) for _ in range(3))
    with ThreadPoolExecutor(3) as pool:
        t0 = time.monotonic()
        drips = [pool.submit(lambda: (ask(live, media.url("/drip")), time.monotonic() - t0)) for _ in range(2)]
        deadline = time.monotonic() + 5
        while media.drips_open < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert media.drips_open == 2
        # The one tokenizer is holding two dripping downloads; text requests go straight past them.
        latencies = [_text_latency(live) for _ in range(3)]
        for future in drips:
            response, elapsed = future.result(30)
            assert_generic_refusal(response)
            assert MEDIA_TIMEOUT_S <= elapsed < MEDIA_TIMEOUT_S + 1.0, elapsed
    assert max(latencies) < baseline + 0.3, (baseline, latencies)


def test_disconnect_cancels_the_download_and_frees_the_slot(live: LiveServer, media: MediaServer) -> None:
    with pytest.raises(httpx.ReadTimeout):
        ask(live, media.url("/drip"), timeout=0.5)
    left = time.monotonic()
    while media.drips_open and time.monotonic() - left < 5:
        time.sleep(0.02)
    # Well before the 3 s deadline: the tokenizer dropped the download when told the client left.
    assert media.drips_open == 0 and time.monotonic() - left < 1.5
    stats: dict[str, Any] = live.stats()
    while stats["tokenizers"][0]["outstanding"] and time.monotonic() - left < 5:
        stats = live.stats()
    assert stats["tokenizers"][0]["outstanding"] == 0
