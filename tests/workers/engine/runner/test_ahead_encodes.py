"""Encoding ahead on CUDA (``encode_ahead_tokens``): the ahead encodes run on a second stream beside the forward, and
the answers are the same greedy tokens as the same engine's without them, on a Qwen2.5-VL and a Qwen3-VL (DeepStack
entries) demo checkpoint. The CPU runs them in line (test_offline.py, token-exact against transformers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ipc.prompts import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _chats() -> list[list[dict[str, object]]]:
    def image(w: int, h: int, seed: int) -> Image.Image:
        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))

    return [[{"role": "user", "content": [*({"type": "image", "image": image(96 + 32 * i, 80, 10 * i + j)}
                                            for j in range(3)), {"type": "text", "text": f"Compare {i}."}]}]
            for i in range(4)]


def _answers(model_dir: Path, ahead: int) -> tuple[list[list[int]], int]:
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", chunk_size=128,
                                 lone_prefill_tokens=128, max_num_seqs=2, encode_ahead_tokens=ahead,
                                 vit_max_patches=1))  # a ViT call per image either way: the same GEMM shapes
    rids = [engine.add_request(chat, GREEDY) for chat in _chats()]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        done.update((out.rid, out.token_ids) for out in engine.step())
    images = engine.runner.ahead.images
    assert engine.runner.counters.images_encoded == 12  # every image once, ahead or not
    del engine
    torch.cuda.empty_cache()
    return [done[rid] for rid in rids], images


@pytest.mark.parametrize("fixture", ["demo_model_dir", "qwen3_model_dir"])
def test_ahead_encodes_on_a_second_stream_keep_the_answers(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    plain, none_ahead = _answers(model_dir, 0)
    ahead, images_ahead = _answers(model_dir, 4096)
    assert none_ahead == 0 and images_ahead > 0
    assert ahead == plain
