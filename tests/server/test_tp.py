"""Tensor parallelism end to end: `glimpse serve --tp 2` over gloo on the CPU, real processes."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.reference import greedy_text
from tests.server.live import LiveServer, data_url, image_message, png_bytes
from workers.engine.runner.model_runner import split_by_patches

MAX_NEW = 12
ODD = [(57, 83), (300, 200), (123, 77), (640, 480), (29, 29)]
FIVE = [png_bytes(w, h, seed=50 + i) for i, (w, h) in enumerate(ODD)]


@pytest.fixture(scope="module")
def tp2(demo_model_dir: Path) -> Iterator[LiveServer]:
    server = LiveServer(demo_model_dir, "--tp", "2", "--tokenizer-workers", "1", "--chunk-size", "64")
    yield server
    assert server.stop() == 0, server.output()
    assert server.segments() == []


def ask(server: LiveServer, images: list[bytes], text: str) -> str:
    resp = server.client(timeout=120).chat.completions.create(
        model="demo", messages=image_message(text, [data_url(b) for b in images]),  # type: ignore[arg-type]
        max_tokens=MAX_NEW, temperature=0,
    )
    return resp.choices[0].message.content or ""


@pytest.mark.parametrize("count", [1, 5])
def test_tp2_equals_transformers(tp2: LiveServer, demo_model_dir: Path, count: int) -> None:
    """TP=2 answers as transformers does (test_serving.py holds the one-rank server to it too)."""
    images, text = FIVE[:count], f"Describe these {count} pages."
    expected = greedy_text(demo_model_dir, images, text, MAX_NEW)
    ahead = tp2.stats()["steps_ahead"]
    assert ask(tp2, images, text) == expected
    # Asynchronous scheduling under TP: steps were planned before the last one's result, and the ranks other than 0
    # took their input ids from rank 0's samples broadcast on the device.
    assert tp2.stats()["steps_ahead"] >= ahead + MAX_NEW // 2


def test_tp2_without_asynchronous_scheduling_gives_the_same_tokens(demo_model_dir: Path) -> None:
    server = LiveServer(demo_model_dir, "--tp", "2", "--tokenizer-workers", "1", "--chunk-size", "64", "--no-async-scheduling")
    try:
        images, text = FIVE[:2], "Describe these 2 pages."
        assert ask(server, images, text) == greedy_text(demo_model_dir, images, text, MAX_NEW)
        assert server.stats()["steps_ahead"] == 0
    finally:
        assert server.stop() == 0, server.output()


def test_each_rank_reads_only_its_share_of_shm(tp2: LiveServer) -> None:
    images = [png_bytes(w, h, seed=90 + i) for i, (w, h) in enumerate([(400, 300), (200, 120), (90, 90), (310, 250)])]
    before = {w["rank"]: w["pixel_reads"] for w in tp2.stats()["model_workers"]}
    # One chunk covers the whole prompt, so the four images are encoded in one step, split by patches.
    resp = tp2.client(timeout=120).chat.completions.create(
        model="demo", messages=image_message("Read all.", [data_url(b) for b in images]),  # type: ignore[arg-type]
        max_tokens=2, extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 10
    while True:
        workers = {w["rank"]: w for w in tp2.stats()["model_workers"]}
        reads = {r: workers[r]["pixel_reads"] - before.get(r, 0) for r in (0, 1)} if len(workers) == 2 else {}
        if sum(reads.values()) == 4 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(reads.values()) == 4, reads  # every image read once in all, by one rank
    assert reads[0] > 0 and reads[1] > 0, reads  # and the work was split across both ranks


def test_split_follows_patch_counts() -> None:
    # 4 images: two large, two small -> one large + one small each, whatever their order in the prompt.
    assert split_by_patches([400, 30, 380, 20], 2) == [[0, 3], [1, 2]]


def test_killing_one_rank_fails_cleanly(demo_model_dir: Path) -> None:
    server = LiveServer(demo_model_dir, "--tp", "2", "--tokenizer-workers", "1")
    try:
        ranks = server.child_pids("model[1]")
        assert len(ranks) == 1
        stream = server.client(timeout=60).chat.completions.create(
            model="demo", messages=image_message("Go on.", [data_url(FIVE[1])]),  # type: ignore[arg-type]
            max_tokens=5000, stream=True, extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        os.kill(ranks[0], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in stream:
                pass
        assert time.monotonic() - killed < 1.5
        assert server.proc.wait(30) != 0
    finally:
        server.stop(signal.SIGKILL)
    assert server.segments() == []


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_graph_decode_on_cuda_gives_the_eager_tokens(demo_model_dir: Path) -> None:
    """TP=2 on two GPUs (NCCL): decode graphs that capture the all-reduces give the eager decode's greedy tokens
    (float32, so the two differ by rounding only), and so does the synchronous path, where no rank needs rank 0's
    samples broadcast on the device. Three prompts at once, so steps planned ahead carry several sequences."""
    flags = ("--tp", "2", "--device", "cuda", "--dtype", "float32", "--tokenizer-workers", "1")
    answers = []
    for extra, env in (((), {}), ((), {"GLIMPSE_CUDA_GRAPHS": "0"}), (("--no-async-scheduling",), {})):
        server = LiveServer(demo_model_dir, *flags, *extra, env=env, ready_timeout=300)
        try:
            client = server.client(timeout=120)
            with ThreadPoolExecutor(3) as pool:
                texts = list(pool.map(
                    lambda n, client=client: client.completions.create(
                        model="demo", prompt=f"Count to {n}: " + "one " * n, max_tokens=24, temperature=0
                    ).choices[0].text,
                    (3, 20, 40),
                ))
            answers.append(texts)
            if not extra:
                assert server.stats()["steps_ahead"] > 0
        finally:
            assert server.stop() == 0, server.output()
    assert answers[0] == answers[1] == answers[2]
