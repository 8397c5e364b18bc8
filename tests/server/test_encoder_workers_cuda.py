"""`glimpse serve --encoder-workers 1 --encoder-landing-mb 4096 --device cuda` (the encoder colocated on the language
model's GPU, its landing pool on): greedy answers equal the plain CUDA server's, every entry lands in the encoder's
CUDA pool and reaches the model worker through CUDA IPC (none through /dev/shm), and every range is released once its
import step is over."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.server.live import LiveServer
from tests.server.test_encoder_workers import ARGS, PAGES, ask, stopped_clean, wait_for_stats

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# float32: the encoder's ViT calls batch images unlike the model worker's, and float32 keeps that below any argmax.
CUDA_ARGS = (*ARGS, "--device", "cuda", "--dtype", "float32")


def test_cuda_landing_answers_equal_the_plain_cuda_server(demo_model_dir: Path) -> None:
    split = LiveServer(demo_model_dir, *CUDA_ARGS, "--encoder-workers", "1", "--encoder-landing-mb", "4096",
                       ready_timeout=300)
    try:
        plain = LiveServer(demo_model_dir, *CUDA_ARGS, ready_timeout=300)
    except BaseException:
        split.stop()
        raise
    try:
        for images, text in [(PAGES[:3], "Compare these three pages."), (PAGES[1:], "And now these?"),
                             (PAGES[3:], "One more.")]:
            assert ask(split, images, text) == ask(plain, images, text)
        stats = split.stats_when("images_encoded", len(PAGES))
        [encoder] = stats["encoder_workers"]
        assert encoder["landing_pool_bytes"] > 0, encoder
        assert (encoder["cuda_landings"], encoder["shm_landings"]) == (len(PAGES), 0), encoder
        assert stats["shm"]["landing_segments"] == 0 and stats["shm"]["landing_bytes"] == 0
        released = wait_for_stats(split, lambda s: s["encoder_workers"][0]["landing_pool_used_bytes"] == 0)
        assert released["encoder_workers"][0]["landing_pool_used_bytes"] == 0
    finally:
        try:
            stopped_clean(split)
        finally:
            stopped_clean(plain)
