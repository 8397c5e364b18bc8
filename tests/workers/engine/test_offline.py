"""Greedy tokens of the offline Engine equal transformers' generate on the demo checkpoint (CPU, float32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from ipc.prompts import SamplingParams
from tests.workers.engine.hf_reference import chat, greedy_tokens
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
ODD_SIZES = [(57, 83), (300, 200), (123, 77), (640, 480), (29, 29)]


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


class Reference:
    def __init__(self, model_dir: Path) -> None:
        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def generate(self, messages: list[dict[str, Any]]) -> list[int]:
        return greedy_tokens(self.processor, self.model, messages, MAX_NEW)


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path) -> Reference:
    return Reference(demo_model_dir)


def make_engine(model_dir: Path, **overrides: Any) -> Engine:
    # lone_prefill_tokens 0: a lone prompt keeps chunk_size, so the chunk sizes below really split the images
    args: dict[str, Any] = dict(
        model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=512, block_size=16, lone_prefill_tokens=0
    )
    args.update(overrides)
    return Engine(EngineConfig(**args))


FIVE = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(ODD_SIZES)]


def test_text_only(demo_model_dir: Path, reference: Reference) -> None:
    messages = [{"role": "user", "content": "Describe the chart on page three."}]
    [out] = make_engine(demo_model_dir).generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)


def test_one_image(demo_model_dir: Path, reference: Reference) -> None:
    messages = chat("What is in this picture?", [noise_image(300, 200, seed=42)])
    [out] = make_engine(demo_model_dir).generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)


@pytest.mark.parametrize("chunk_size", [16, 64, 4096])
def test_five_odd_images_any_chunk_size(demo_model_dir: Path, reference: Reference, chunk_size: int) -> None:
    messages = chat("Compare these five pages.", FIVE)
    engine = make_engine(demo_model_dir, chunk_size=chunk_size)
    [out] = engine.generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)
    # Each distinct image is encoded exactly once, however the chunks split the spans.
    assert engine.stats()["images_encoded"] == 5


def test_eight_concurrent_requests(demo_model_dir: Path, reference: Reference) -> None:
    requests = [
        chat("Short one." * (1 + i), [noise_image(60 + 30 * i, 90 - 5 * i, seed=100 + i)] * (i % 3)) for i in range(8)
    ]
    engine = make_engine(demo_model_dir, chunk_size=64)
    outs = engine.generate(requests, GREEDY)
    for messages, out in zip(requests, outs, strict=True):
        assert out.token_ids == reference.generate(messages)
    # The batch really ran together: some step carried several sequences.
    assert engine.runner.counters.steps < sum(len(o.token_ids) for o in outs)


@pytest.mark.parametrize("limit", [{"decode_step_image_tokens": 1}, {"encode_token_cost": 1000.0}],
                         ids=["image-cap", "encode-cost"])
def test_image_token_cap_of_decode_steps_is_exact(
    demo_model_dir: Path, reference: Reference, limit: dict[str, float]
) -> None:
    # Staggered requests with several images each: once one decodes, a step encodes one image at most (the cap is
    # below any image's tokens, or each image costs more than the step's budget), and the answers do not change.
    requests = [chat(f"Look {i}.", [noise_image(90 + 20 * i, 70, seed=200 + 3 * i + j) for j in range(3)])
                for i in range(3)]
    engine = make_engine(demo_model_dir, chunk_size=256, **limit)
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    rids = [engine.add_request(requests[0], sampling)]
    per_step: list[int] = []
    done = {}
    while engine.has_unfinished() or len(rids) < len(requests):
        if len(per_step) in (2, 4):  # later arrivals, while the first decodes
            rids.append(engine.add_request(requests[len(per_step) // 2], sampling))
        done.update((out.rid, out.token_ids) for out in engine.step())
        per_step.append(engine.step_log[-1][0])
    assert [done[rid] for rid in rids] == [reference.generate(m) for m in requests]
    assert per_step[0] == 3 and max(per_step[1:]) == 1 and sum(per_step) == 9, per_step


def test_images_encoded_ahead_give_the_same_answers(demo_model_dir: Path, reference: Reference) -> None:
    # A small chunk and a waiting queue: steps encode the images of later chunks and of the next request ahead of
    # the steps that read them (on the CPU right after the forward), and every image is still encoded once.
    requests = [chat(f"Compare {i}.", [noise_image(90 + 20 * i, 70, seed=300 + 3 * i + j) for j in range(3)])
                for i in range(3)]
    engine = make_engine(demo_model_dir, chunk_size=96, max_num_seqs=2, encode_ahead_tokens=64)
    rids = [engine.add_request(m, GREEDY) for m in requests]
    done = {}
    while engine.has_unfinished():
        done.update((out.rid, out.token_ids) for out in engine.step())
    assert [done[rid] for rid in rids] == [reference.generate(m) for m in requests]
    runner = engine.runner
    assert runner.ahead.images > 0 and runner.counters.images_encoded == 9  # ahead, and never twice
    assert sum(n for n, _ in engine.step_log) == 9  # each counted by the step that ran it


@pytest.mark.parametrize("block_size", [16, 128])  # 128: what `glimpse serve` takes on CUDA (whole FA3 key tiles)
def test_second_request_reuses_cached_embeddings(demo_model_dir: Path, reference: Reference, block_size: int) -> None:
    engine = make_engine(demo_model_dir, chunk_size=64, block_size=block_size)
    first = chat("Read these.", FIVE[:3])
    engine.generate([first], GREEDY)
    encoded = engine.stats()["images_encoded"]
    assert encoded == 3
    second = first + [
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": [{"type": "image", "image": FIVE[3]}, {"type": "text", "text": "And this?"}]},
    ]
    [out] = engine.generate([second], GREEDY)
    assert out.token_ids == reference.generate(second)
    stats = engine.stats()
    assert stats["images_encoded"] == encoded + 1  # only the new image went through the ViT
    assert stats["mm_cache"]["hits"] >= 3
    assert stats["prefix_cache_hit_tokens"] >= block_size  # the first turn's blocks (across its images) reused


def test_cache_smaller_than_one_request_is_still_exact(demo_model_dir: Path, reference: Reference) -> None:
    messages = chat("Compare these five pages.", FIVE)
    # Room for about one image's embeddings: the rest are encoded for one step and dropped.
    engine = make_engine(demo_model_dir, chunk_size=32, mm_cache_mb=0.02)
    [out] = engine.generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)
    stats = engine.stats()["mm_cache"]
    assert stats["bytes"] <= 0.02 * (1 << 20)
    assert stats["refused"] > 0 or stats["evictions"] > 0


def test_baseline_request_mode_is_exact(demo_model_dir: Path, reference: Reference) -> None:
    messages = chat("Compare these five pages.", FIVE)
    engine = make_engine(demo_model_dir, chunk_size=16, mm_cache_mode="request")
    [out] = engine.generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)
    # Baseline: every image encoded in the first step, in one ViT call.
    assert engine.step_log[0] == (5, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fast_paths_give_the_eager_tokens(demo_model_dir: Path) -> None:
    """CUDA, float32: fused kernels, the paged embedding pool (with hits across requests) and cuDNN frame
    attention against the same engine with every fast path off; float32 differs by rounding only, so
    greedy tokens must agree. Small chunks make images straddle chunks (and pool pages)."""
    prompts = [chat("Compare.", FIVE[:3]), chat("Again, briefly.", [FIVE[2], FIVE[0], FIVE[4]])]
    outputs = {}
    for fast in (True, False):
        engine = make_engine(demo_model_dir, device="cuda", chunk_size=64, fused_kernels=fast)
        store = engine.runner.store
        assert (store.pool is not None) and store.pool_misses == 0  # the pool is CUDA's, either way
        if not fast:
            engine.runner.graphs = None
        outputs[fast] = [o.token_ids for o in engine.generate(prompts[:1], GREEDY)]
        outputs[fast] += [o.token_ids for o in engine.generate(prompts[1:], GREEDY)]
        assert engine.stats()["mm_cache"]["hits"] >= 2  # FIVE[2] and FIVE[0] came back from the pool
    assert outputs[True] == outputs[False]
