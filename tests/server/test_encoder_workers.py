"""`glimpse serve --encoder-workers 1` end to end (real processes, real shm, real ZMQ, the official openai client):
greedy answers to multi-image chats equal the same checkpoint's server without encoder workers (the session's shared
one; test_serving.py and test_qwen3_serving.py hold it token-exact against transformers), on Qwen2.5-VL and Qwen3-VL
(DeepStack levels travel in the landing segment); the model worker encodes nothing and holds no vision weights, the
encoder encodes everything, landed entries leave the shm budget once imported, and a resent image is not encoded
again. Killing the encoder mid-request fails what is in flight at once (a request waiting on it included), stops the
server non-zero and leaves no segment of the launch."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.live import LiveServer, data_url, image_message, png_bytes

MAX_NEW = 12
# --chunk-size 64: prompts of several images take several chunks, so images land while earlier chunks run.
ARGS = ("--tokenizer-workers", "1", "--chunk-size", "64", "--max-model-len", "2048")
PAGES = [png_bytes(w, h, seed=90 + i) for i, (w, h) in enumerate([(300, 200), (57, 83), (123, 77), (200, 300)])]


def ask(server: LiveServer, images: list[bytes], text: str) -> str:
    resp = server.client(timeout=120).chat.completions.create(
        model="demo", messages=image_message(text, [data_url(b) for b in images]),  # type: ignore[arg-type]
        max_tokens=MAX_NEW, temperature=0,
    )
    return resp.choices[0].message.content or ""


def wait_for_stats(server: LiveServer, cond: Callable[[dict[str, Any]], bool], timeout: float = 5.0) -> dict[str, Any]:
    """/admin/stats once ``cond`` holds (the scheduler's figures arrive every 0.25 s), or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond(stats := server.stats()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats


def stopped_clean(server: LiveServer) -> None:
    assert server.stop() == 0, server.output()
    assert server.segments() == []


@contextmanager
def with_encoders(model_dir: Path, *flags: str) -> Iterator[LiveServer]:
    """A server with ``flags`` (its encoder workers), stopped clean at the end."""
    server = LiveServer(model_dir, *ARGS, *flags)
    yield server
    stopped_clean(server)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[LiveServer, LiveServer]]:
    """(a server with one encoder worker, the session's server of the same checkpoint without), on one family's demo
    checkpoint; the two chunk prompts differently (ARGS), which greedy answers never depend on."""
    qwen2 = request.param == "qwen2_5_vl"
    model_dir: Path = request.getfixturevalue("demo_model_dir" if qwen2 else "qwen3_model_dir")
    plain: LiveServer = request.getfixturevalue("demo_server" if qwen2 else "qwen3_server")
    with with_encoders(model_dir, "--encoder-workers", "1") as split:
        yield split, plain


def test_multi_image_answers_equal_the_server_without_encoders(pair: tuple[LiveServer, LiveServer]) -> None:
    split, plain = pair
    for images, text in [(PAGES[:3], "Compare these three pages."), (PAGES[1:], "And now these?"),
                         (PAGES[3:], "One more.")]:
        assert ask(split, images, text) == ask(plain, images, text)
    stats = split.stats_when("images_encoded", len(PAGES))
    # The model worker ran no ViT and read no pixels: the encoder did all of it.
    [worker] = stats["model_workers"]
    assert (worker["images_encoded"], worker["vit_calls"], worker["pixel_reads"], worker["vit_graph_replays"]) == (0,) * 4, worker
    # It built no vision tower at all: its weights are the plain server's less the tower's.
    [plain_worker] = plain.stats()["model_workers"]
    assert worker["vision_weight_bytes"] == 0 < plain_worker["vision_weight_bytes"], (worker, plain_worker)
    assert worker["weight_bytes"] == plain_worker["weight_bytes"] - plain_worker["vision_weight_bytes"]
    # Every landed entry was imported and unlinked: nothing of it is left in the shm budget.
    assert wait_for_stats(split, lambda s: s["shm"]["landing_bytes"] == 0)["shm"]["landing_segments"] == 0
    [encoder] = stats["encoder_workers"]
    assert encoder["images_encoded"] == encoder["jobs"] == len(PAGES) and encoder["failed"] == 0, encoder
    assert stats["images_encoded"] == len(PAGES)
    metrics = httpx.get(split.base + "/metrics").text
    assert f'glimpse_encoder_images_encoded_total{{encoder="0"}} {float(len(PAGES))}' in metrics
    assert plain.stats()["encoder_workers"] == []


def test_a_resent_image_is_not_encoded_again(pair: tuple[LiveServer, LiveServer]) -> None:
    split, _ = pair
    first = png_bytes(160, 120, seed=7)
    ask(split, [first], "Look at this.")
    before = split.stats_when("images_encoded", len(PAGES) + 1)
    assert before["encoder_workers"][0]["images_encoded"] == len(PAGES) + 1
    ask(split, [first, PAGES[0]], "Look again, with a page seen before.")
    time.sleep(0.5)  # counters arrive every 0.25 s
    after = split.stats()
    assert after["encoder_workers"][0]["images_encoded"] == before["encoder_workers"][0]["images_encoded"]
    assert after["images_encoded"] == before["images_encoded"]
    # (The first image may sit inside prefix-cache blocks, read by no chunk: the page is a hit at least.)
    assert after["mm_cache"]["hits"] >= before["mm_cache"]["hits"] + 1
    assert after["model_workers"][0]["images_encoded"] == 0


def kill_encoder_under_load(server: LiveServer, seed: int, all_running: Callable[[], bool]) -> None:
    """One streamed image request decoding, a second whose image the (frozen) encoder never answers; once
    ``all_running()`` says both are in, SIGKILL the encoder: both must fail fast and the server stop (the checks of
    ``LiveServer.assert_crash_failed_fast``)."""
    [encoder] = server.child_pids("encoder")
    body = {"model": "demo", "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "messages": image_message("Describe it at length.", [data_url(png_bytes(90, 60, seed=seed))])}
    with httpx.stream("POST", server.base + "/v1/chat/completions", timeout=30, json=body) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # decoding: its image went through the encoder already
        os.kill(encoder, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, server.base + "/v1/chat/completions", timeout=30, json={
                "model": "demo", "max_tokens": 4,
                "messages": image_message("And this?", [data_url(png_bytes(70, 50, seed=seed + 1))]),
            })
            deadline = time.monotonic() + 10
            while not all_running() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all_running()
            os.kill(encoder, signal.SIGKILL)
            killed = time.monotonic()
            server.crashed = True
            events = [line for line in lines if line.startswith("data: ")]
            answer = waiting.result(10)
    server.assert_crash_failed_fast(events, answer, killed, "encoder[0]")


def test_a_killed_encoder_fails_requests_in_flight_and_stops_the_server(demo_model_dir: Path) -> None:
    server = LiveServer(demo_model_dir, *ARGS, "--encoder-workers", "1")
    try:
        kill_encoder_under_load(server, 11, lambda: server.stats()["requests"]["running"] == 2)
    finally:
        server.stop(signal.SIGKILL)
    assert server.segments() == []
