"""The embedding cache's host tier through the offline Engine on the demo checkpoint (CPU, float32): a GPU tier
smaller than the working set spills what it evicts, and a request that needs those images again reloads them, with
no re-encode and the tokens of a run whose GPU tier holds everything (and of transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from ipc.prompts import SamplingParams
from tests.conftest import noise_image
from tests.workers.engine.hf_reference import chat, greedy_tokens
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
# Three images of 12 tokens (3,072 bytes of embeddings each in float32 on the demo model): a GPU tier of 8 KiB holds
# two, so admitting the third evicts the least recently used.
GPU_MB = 8192 / 2**20
IMAGES = [noise_image(123, 77, seed=s) for s in (11, 12, 13)]


def make_engine(model_dir: Path, async_scheduling: bool = False, **overrides: Any) -> Engine:
    # Chunks of 16 tokens: a chunk reads at most two of the images (their spans are 23-35, 37-49, 51-63), which the
    # GPU tier holds side by side. No prefix cache: a second request reads its images' embeddings again instead of
    # reusing the first one's KV.
    args: dict[str, Any] = dict(
        model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256, block_size=16, lone_prefill_tokens=0,
        chunk_size=16, enable_prefix_caching=False,
    )  # fmt: skip
    args.update(overrides)
    return Engine(EngineConfig(**args), async_scheduling=async_scheduling)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_evicted_images_come_back_from_the_host_tier(demo_model_dir: Path, async_scheduling: bool) -> None:
    first, second = chat("Compare these.", IMAGES), chat("Once more, the same three.", IMAGES)
    big = make_engine(demo_model_dir, async_scheduling)  # 1 GiB GPU tier: every image stays there
    expected = [out.token_ids for out in big.generate([first], GREEDY) + big.generate([second], GREEDY)]

    engine = make_engine(demo_model_dir, async_scheduling, mm_cache_mb=GPU_MB, mm_host_cache_mb=1)
    [out] = engine.generate([first], GREEDY)
    assert out.token_ids == expected[0]
    stats = engine.stats()
    assert stats["images_encoded"] == 3 and stats["mm_host_cache"]["spills"] == 1  # the first went to the host
    vit_calls = stats["vit_calls"]

    [out] = engine.generate([second], GREEDY)
    assert out.token_ids == expected[1]
    stats = engine.stats()
    host = stats["mm_host_cache"]
    assert stats["images_encoded"] == 3 and stats["vit_calls"] == vit_calls  # nothing encoded a second time
    assert host["hits"] == host["reloads"] == host["worker_reloads"] == 3
    assert host["spills"] == host["worker_spills"] == 4  # each reload pushed the GPU tier's oldest entry down
    assert stats["mm_cache"]["bytes"] == 2 * 3072 and host["bytes"] == 3072 and host["entries"] == 1
    # Scheduler index and worker stores agree, tier by tier.
    assert len(engine.runner.host) == len(engine.core.mm_index.host) == 1
    assert len(engine.runner.store) == len(engine.core.mm_index) == 2


def test_host_tier_answers_like_transformers(demo_model_dir: Path) -> None:
    """The same two requests against transformers' generate: the reloaded rows are the encoded ones."""
    processor = AutoProcessor.from_pretrained(str(demo_model_dir))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(demo_model_dir), dtype=torch.float32).eval()
    engine = make_engine(demo_model_dir, mm_cache_mb=GPU_MB, mm_host_cache_mb=1)
    for messages in (chat("Compare these.", IMAGES), chat("Which is brightest?", IMAGES[::-1])):
        [out] = engine.generate([messages], GREEDY)
        assert out.token_ids == greedy_tokens(processor, model, messages, GREEDY.max_tokens)
    assert engine.stats()["images_encoded"] == 3 and engine.stats()["mm_host_cache"]["reloads"] == 1


def test_host_tier_is_off_by_default_on_the_cpu(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir, mm_cache_mb=GPU_MB)
    engine.generate([chat("Compare these.", IMAGES)], GREEDY)
    host = engine.stats()["mm_host_cache"]
    assert host["budget_bytes"] == 0 and host["spills"] == 0 and engine.runner.host.pool is None
    assert engine.stats()["mm_cache"]["evictions"] == 1  # an evicted entry is dropped, as before the tier


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_tier_reloads_give_the_big_cache_tokens(demo_model_dir: Path) -> None:
    """CUDA, float32: the pinned pool, the side-stream reloads and the paged GPU store, against a GPU tier that holds
    everything (both planned ahead, so reloads overlap the step before)."""
    first, second = chat("Compare these.", IMAGES), chat("Once more, the same three.", IMAGES)
    outputs = []
    for gpu_mb, host_mb in ((1024.0, 0.0), (GPU_MB, 1.0)):
        engine = make_engine(demo_model_dir, True, device="cuda", mm_cache_mb=gpu_mb, mm_host_cache_mb=host_mb)
        outputs.append([out.token_ids for out in engine.generate([first], GREEDY) + engine.generate([second], GREEDY)])
    assert outputs[0] == outputs[1]
    host = engine.stats()["mm_host_cache"]
    assert engine.stats()["images_encoded"] == 3 and host["worker_reloads"] == 3 and engine.runner.host.pool is not None
