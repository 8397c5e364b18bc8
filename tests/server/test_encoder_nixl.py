"""`glimpse serve --encoder-workers 1 --encoder-transport nixl` end to end (real processes, NIXL's UCX backend on
the host's loopback, the official openai client): greedy answers to multi-image chats equal the session's demo
server's, which has no encoder workers (held token-exact against transformers elsewhere); every entry crosses in the
encoder's NIXL-registered pool (none through /dev/shm), its range goes back once imported, the model worker encodes
nothing, and the server stops clean."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.encoder_flags import check_transport
from tests.server.live import LiveServer, png_bytes
from tests.server.test_encoder_workers import ask, wait_for_stats, with_encoders

PAGES = [png_bytes(w, h, seed=40 + i) for i, (w, h) in enumerate([(220, 160), (64, 90), (150, 100)])]


@pytest.fixture(scope="module")
def pair(demo_model_dir: Path, demo_server: LiveServer) -> Iterator[tuple[LiveServer, LiveServer]]:
    """(the NIXL server, the session's demo server without encoders)."""
    with with_encoders(demo_model_dir, "--encoder-workers", "1", "--encoder-transport", "nixl",
                       "--encoder-landing-mb", "64") as split:
        yield split, demo_server


def test_answers_equal_and_every_entry_crosses_through_nixl(pair: tuple[LiveServer, LiveServer]) -> None:
    split, plain = pair
    for images, text in [(PAGES, "Compare these pages."), (PAGES[1:], "And these two?")]:
        assert ask(split, images, text) == ask(plain, images, text)
    stats = split.stats_when("images_encoded", len(PAGES))
    [worker] = stats["model_workers"]
    assert (worker["images_encoded"], worker["vit_calls"], worker["pixel_reads"]) == (0, 0, 0), worker
    assert worker["nixl_reads"] == len(PAGES) and worker["nixl_bytes"] > 0, worker  # each landed entry, read once
    # The three distinct pages crossed in the pool (the second chat's were cache hits), and once every import's
    # step was over the scheduler released their ranges.
    encoder = wait_for_stats(split, lambda s: s["encoder_workers"][0]["landing_pool_used_bytes"] == 0)["encoder_workers"][0]
    assert (encoder["nixl_landings"], encoder["shm_landings"], encoder["cuda_landings"]) == (len(PAGES), 0, 0), encoder
    assert encoder["landing_pool_bytes"] == 64 << 20 and encoder["landing_pool_used_bytes"] == 0, encoder
    assert stats["shm"]["landing_segments"] == 0
    metrics = httpx.get(split.base + "/metrics").text
    assert f'glimpse_encoder_nixl_landings_total{{encoder="0"}} {float(len(PAGES))}' in metrics


def test_the_flag_is_refused_without_encoders_or_a_pool() -> None:
    with pytest.raises(SystemExit, match="needs --encoder-workers"):
        check_transport("nixl", 0, None)
    with pytest.raises(SystemExit, match="--encoder-landing-mb must be more than 0"):
        check_transport("nixl", 1, 0)
    check_transport("nixl", 1, None)  # installed here: accepted
