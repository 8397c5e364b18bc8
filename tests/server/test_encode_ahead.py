"""`glimpse serve --encode-ahead-tokens` end to end (real processes, real shm, real ZMQ, the official openai client):
with one request running at a time and several waiting, steps encode the next request's images while the current one
runs, the answers equal the session's demo server's, which encodes nothing ahead (test_serving.py holds it token-exact
against transformers), every image is encoded once, /admin/stats counts the images encoded ahead, and no segment is
left."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.server.live import LiveServer, data_url, image_message, png_bytes

ARGS = ("--tokenizer-workers", "1", "--chunk-size", "64", "--max-model-len", "2048", "--max-num-seqs", "1")
CHATS = [([png_bytes(w, h, seed=40 + i) for i, (w, h) in enumerate(sizes)], text) for sizes, text in [
    ([(200, 140), (90, 60)], "Compare these."), ([(64, 96)], "What is this?"), ([(120, 80), (80, 120)], "Which?")]]


def ask(server: LiveServer, images: list[bytes], text: str) -> str:
    resp = server.client(timeout=120).chat.completions.create(
        model="demo", messages=image_message(text, [data_url(b) for b in images]),  # type: ignore[arg-type]
        max_tokens=10, temperature=0,
    )
    return resp.choices[0].message.content or ""


def test_images_encoded_ahead_answer_as_without(demo_model_dir: Path, demo_server: LiveServer) -> None:
    ahead = LiveServer(demo_model_dir, *ARGS, "--encode-ahead-tokens", "4096")
    try:
        with ThreadPoolExecutor(len(CHATS)) as pool:  # all at once: two of them wait behind the first
            answers = list(pool.map(lambda chat: ask(ahead, *chat), CHATS))
        assert answers == [ask(demo_server, *chat) for chat in CHATS]
        images = sum(len(chat[0]) for chat in CHATS)
        stats = ahead.stats_when("images_encoded", images)
        [worker] = stats["model_workers"]
        assert stats["images_encoded"] == worker["images_encoded"] == images  # none twice
        assert 0 < worker["images_ahead"] <= images, worker
        assert worker["ahead_waits"] == 0, worker  # the CPU's one stream: each ahead encode is done before the next step
        assert demo_server.stats()["model_workers"][0]["images_ahead"] == 0
    finally:
        assert ahead.stop() == 0, ahead.output()
    assert ahead.segments() == []
