"""The prefix cache's host tier through the offline Engine on the demo checkpoint (CPU, float32): a GPU pool too small
to keep a request's blocks spills them to host memory when other requests recycle them, and the request's next turn
loads its prefix from there (counted as cached tokens, its image not encoded again) and answers with the tokens of a
run without the tier, and of transformers."""

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
from workers.engine.core.kv_cache import block_hashes
from workers.engine.offline import Engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
BS = 16
# A: 114 prompt tokens (image span 23-99), so 7 full blocks the prefix cache keeps; the first (the system prompt) is
# every request's, so it stays on the GPU. A GPU pool of 12 blocks: each filler (11 blocks) recycles every other block
# A left behind, so A's next turn finds 1 block on the GPU and the next 6 in the host tier.
FIRST = chat("Describe this picture.", [noise_image(300, 200, seed=7)])
NEXT = [*FIRST, {"role": "assistant", "content": "Noise."}, {"role": "user", "content": "And the colours in it?"}]
FILLERS = [chat(f"Filler {i}: " + "count the sheep again and again, " * 12, [noise_image(123, 77, seed=20 + i)])
           for i in range(2)]  # fmt: skip
# 20 KiB of embeddings (256 bytes a token on the demo model): A's 77 rows and a filler's 12 do not fit together, so
# the fillers' images evict A's embedding, and a turn that recomputes A's prefix must encode its image again.
MM_MB = 20480 / 2**20


def make_engine(model_dir: Path, async_scheduling: bool, **overrides: Any) -> Engine:
    args: dict[str, Any] = dict(
        model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=12, block_size=BS, chunk_size=64,
        lone_prefill_tokens=0, mm_cache_mb=MM_MB,
    )  # fmt: skip
    args.update(overrides)
    return Engine(EngineConfig(**args), async_scheduling=async_scheduling)


def first_turns(engine: Engine) -> tuple[list[list[int]], list[bytes], bytes]:
    """A, then the fillers, one after another: the tokens of each, the keys of A's full prompt blocks, and the hash
    of A's image."""
    rid = engine.add_request(FIRST, GREEDY)
    seq = engine.core.seqs[rid]
    keys = block_hashes(seq.input_ids, BS, items=seq.items)
    tokens = []
    while engine.has_unfinished():
        tokens += [out.token_ids for out in engine.step()]
    for filler in FILLERS:
        tokens += [out.token_ids for out in engine.generate([filler], GREEDY)]
    return tokens, keys, seq.items[0].hash


def next_turn(engine: Engine) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
    """A's next turn: its tokens, and the stats before and after it (with its cached tokens)."""
    before = engine.stats()
    [out] = engine.generate([NEXT], GREEDY)
    after = engine.stats()
    after["next_cached_tokens"] = out.cached_tokens
    return out.token_ids, before, after


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_evicted_prefix_comes_back_from_the_host_tier(demo_model_dir: Path, async_scheduling: bool) -> None:
    plain = make_engine(demo_model_dir, async_scheduling)
    expected, _, _ = first_turns(plain)
    expected_next, plain_before, plain_after = next_turn(plain)
    # Without the tier A's prefix is recomputed, and its image, gone from the embedding cache, encoded again.
    assert plain_after["images_encoded"] == plain_before["images_encoded"] + 1
    assert plain_after["next_cached_tokens"] == BS  # the shared system-prompt block alone

    engine = make_engine(demo_model_dir, async_scheduling, kv_host_cache_mb=1)
    tokens, keys, image = first_turns(engine)
    assert tokens == expected and len(keys) == 7
    host = engine.stats()["kv_host_cache"]
    assert host["slots_total"] == engine.runner.host_kv.num_slots > 0  # type: ignore[union-attr]
    # Every block of A's past the shared first left the GPU pool, each spilled on its way out.
    alloc = engine.core.allocator
    assert len(alloc.match(keys)) == 1 and not any(alloc.is_cached(k) for k in keys[1:])
    assert alloc.host is not None and len(alloc.host.match(keys[1:])) == 6
    assert host["spilled_blocks"] >= 6 and host["loaded_blocks"] == 0
    assert image not in engine.core.mm_index  # the fillers' images pushed A's out of the embedding cache

    next_tokens, before, after = next_turn(engine)
    assert next_tokens == expected_next

    host = after["kv_host_cache"]
    assert host["loaded_blocks"] == host["worker_loads"] == 6 and host["hit_tokens"] == 6 * BS
    assert host["spilled_blocks"] == host["worker_spills"]  # the workers copied what the index planned
    assert after["next_cached_tokens"] == 7 * BS  # the request's usage counts both tiers' hits as cached
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == BS  # (the device tier's share)
    # The image lies inside the loaded blocks: not encoded again although the embedding cache lost it.
    assert after["images_encoded"] == before["images_encoded"]
    # Computed: only the new turn's tokens past the loaded prefix.
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    plain_computed = plain_after["prompt_tokens_computed"] - plain_before["prompt_tokens_computed"]
    assert 0 < computed == plain_computed - 6 * BS


def test_host_tier_prefix_answers_like_transformers(demo_model_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(str(demo_model_dir))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(demo_model_dir), dtype=torch.float32).eval()
    engine = make_engine(demo_model_dir, False, kv_host_cache_mb=1)
    first_turns(engine)
    tokens, _, after = next_turn(engine)
    assert after["kv_host_cache"]["loaded_blocks"] == 6
    assert tokens == greedy_tokens(processor, model, NEXT, GREEDY.max_tokens)


def test_gemma4_with_one_block_pool_loads_from_the_host_tier(gemma4_model_dir: Path) -> None:
    """Gemma 4 with --num-window-blocks 0 (every layer's cache in the one pool, caches of two shapes): the host tier
    takes each cache's blocks, and the next turn answers as without it."""
    outputs = []
    for host_mb in (0, 4):
        # A is 279 tokens here (18 blocks); the filler takes all 24 blocks of the pool, so every block of A's too.
        engine = make_engine(gemma4_model_dir, False, num_kv_blocks=24, num_window_blocks=0, kv_host_cache_mb=host_mb,
                             mm_cache_mb=1024)  # fmt: skip
        engine.generate([FIRST], GREEDY)
        engine.generate([chat("Filler: " + "count the sheep again and again, " * 30, [])], GREEDY)
        [out] = engine.generate([NEXT], GREEDY)
        outputs.append(out.token_ids)
    assert outputs[0] == outputs[1]
    host = engine.stats()["kv_host_cache"]
    assert host["loaded_blocks"] == host["worker_loads"] > 0 and out.cached_tokens >= host["loaded_blocks"] * BS


def test_host_tier_is_refused_for_a_hybrid_family(qwen3_5_model_dir: Path) -> None:
    config = EngineConfig(model=str(qwen3_5_model_dir), device="cpu", dtype="float32", kv_host_cache_mb=1)
    with pytest.raises(ValueError, match="--kv-host-cache-mb .*linear-attention"):
        Engine(config)


def test_host_tier_is_off_by_default(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir, False)
    assert engine.runner.host_kv is None and engine.core.allocator.host is None
    assert engine.stats()["kv_host_cache"]["slots_total"] == 0
