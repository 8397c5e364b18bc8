"""`glimpse serve --dp 2 --encoder-workers 1 --shared-encoders` end to end (real processes, real shm, real ZMQ, the
official openai client, the demo model on the CPU): one encoder process serves both replicas. Requests routed to each
replica answer token-exact with one offline engine (as test_dp.py holds a plain --dp 2 server), no model worker
encodes anything, the one encoder's counters appear once in /admin/stats and /metrics and count every image of both
replicas, and an image one replica had is not encoded again for the other. Last, killing that encoder fails what is in flight on both replicas at once, stops the server non-zero and
leaves no segment of the launch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.live import LiveServer, data_url, image_message, png_bytes
from tests.server.test_dp import ask, offline_text, replicas
from tests.server.test_encoder_workers import ARGS, kill_encoder_under_load, wait_for_stats
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine

MAX_NEW = 10
# Round-robin: requests alternate between the replicas, so both send to the one encoder whatever they hold.
SHARED = ("--dp", "2", "--dp-routing", "round-robin", "--encoder-workers", "1", "--shared-encoders")
CASES = [
    ("Describe both pages.", [png_bytes(300, 200, seed=201), png_bytes(123, 77, seed=202)]),
    ("What is this?", [png_bytes(64, 250, seed=203)]),
    ("Compare.", [png_bytes(200, 120, seed=204), png_bytes(90, 90, seed=205)]),
    ("And this one?", [png_bytes(57, 83, seed=206)]),
]
IMAGES = sum(len(images) for _, images in CASES)


@pytest.fixture(scope="module")
def shared(demo_model_dir: Path) -> Iterator[LiveServer]:
    server = LiveServer(demo_model_dir, *ARGS, *SHARED)
    yield server
    server.finish()  # the last test killed the encoder: the server stopped on its own


def test_both_replicas_answer_exactly_through_the_one_encoder(shared: LiveServer, demo_model_dir: Path) -> None:
    assert len(shared.child_pids("encoder")) == 1  # N in all, not N per replica
    assert len(shared.child_pids("model")) == 2
    offline = Engine(EngineConfig(model=str(demo_model_dir), num_kv_blocks=512))
    for text, images in CASES:
        resp = ask(shared, image_message(text, [data_url(b) for b in images]), max_tokens=MAX_NEW)
        assert resp.choices[0].message.content == offline_text(offline, text, images, MAX_NEW), text
    assert [r["routed"] for r in replicas(shared)] == [2, 2]  # both replicas sent their images to it
    stats = shared.stats_when("images_encoded", IMAGES)
    # The model workers of both replicas ran no ViT and read no pixels.
    assert [(w["images_encoded"], w["vit_calls"], w["pixel_reads"]) for w in stats["model_workers"]] == [(0, 0, 0)] * 2
    # The encoder is listed once (its counters go to replica 0's scheduler only), with every image of both.
    [encoder] = stats["encoder_workers"]
    assert encoder["index"] == 0 and encoder["images_encoded"] == encoder["jobs"] == IMAGES, encoder
    assert encoder["failed"] == 0 and stats["images_encoded"] == IMAGES
    # Each replica imported and unlinked what it was handed: nothing landed is left in either's shm budget.
    assert wait_for_stats(shared, lambda s: s["shm"]["landing_segments"] == 0)["shm"]["landing_bytes"] == 0
    metrics = [line for line in httpx.get(shared.base + "/metrics").text.splitlines()
               if line.startswith("glimpse_encoder_images_encoded_total")]
    assert metrics == [f'glimpse_encoder_images_encoded_total{{encoder="0"}} {float(IMAGES)}'], metrics


def test_an_image_another_replica_had_is_not_encoded_again(shared: LiveServer, demo_model_dir: Path) -> None:
    """Round-robin sends the fifth request to the replica that did not serve the second case, whose cache never saw
    that image: it asks the encoder (one more job), which answers from its recent entries, and the answer is exact."""
    text, images = CASES[1]
    offline = Engine(EngineConfig(model=str(demo_model_dir), num_kv_blocks=512))
    resp = ask(shared, image_message(text, [data_url(b) for b in images]), max_tokens=MAX_NEW)
    assert resp.choices[0].message.content == offline_text(offline, text, images, MAX_NEW)
    stats = wait_for_stats(shared, lambda s: s["encoder_workers"][0]["jobs"] == IMAGES + len(images))
    [encoder] = stats["encoder_workers"]
    assert (encoder["images_encoded"], encoder["reused"]) == (IMAGES, len(images)), encoder
    assert encoder["recent_bytes"] > 0 and sorted(r["routed"] for r in replicas(shared)) == [2, 3]
    reused = [line for line in httpx.get(shared.base + "/metrics").text.splitlines()
              if line.startswith("glimpse_encoder_reused_total")]
    assert reused == [f'glimpse_encoder_reused_total{{encoder="0"}} {float(len(images))}'], reused


def test_a_killed_shared_encoder_fails_both_replicas_requests_and_leaves_no_shm(shared: LiveServer) -> None:
    # The second request goes to the other replica (round-robin): each replica has one request on the encoder.
    kill_encoder_under_load(shared, 211, lambda: [r["requests"]["running"] for r in replicas(shared)] == [1, 1])
