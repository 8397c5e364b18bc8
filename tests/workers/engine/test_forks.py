"""n > 1 as forked sequences: the prompt (and its images) is computed once, the choices share its full KV
blocks and copy the partial one, and each choice decodes as if it had been prefilled on its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ipc.prompts import SamplingParams
from tests.conftest import noise_image
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine


def make_engine(model_dir: Path, **overrides: Any) -> Engine:
    args: dict[str, Any] = dict(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256, block_size=16)
    args.update(overrides)
    return Engine(EngineConfig(**args))


def chat(text: str, images: int = 0) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image", "image": noise_image(90, 60, seed=i)} for i in range(images)]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


@pytest.mark.parametrize("images", [0, 2])
def test_greedy_choices_equal_one_prefill_of_their_own(demo_model_dir: Path, images: int) -> None:
    messages = chat("Compare the totals on both pages.", images)
    single = make_engine(demo_model_dir)
    [alone] = single.generate([messages], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine = make_engine(demo_model_dir)
    outs = engine.generate([messages], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, n=3))
    assert len(outs) == 3
    # Identical choices prove the copied partial block and the shared full ones hold the parent's KV.
    assert all(o.token_ids == alone.token_ids for o in outs)
    stats = engine.stats()
    assert stats["prompt_tokens_computed"] == alone.prompt_tokens  # one prefill for three choices
    assert stats["images_encoded"] == images
    assert stats["prefix_cache_hit_tokens"] == 0  # shared by forking, not found in the cache
    assert stats["kv_blocks_used"] == 0  # every shared block released with the last choice


def test_prompt_ending_on_a_block_boundary(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir)
    prompt = engine.processor.build(engine.processor.render(chat("x")), [])
    # Grow the text until the prompt is a whole number of blocks: no partial block to copy.
    text = "x"
    while len(engine.processor.build(engine.processor.render(chat(text)), []).input_ids) % 16:
        text += " x"
    assert len(prompt.input_ids) > 0
    [alone] = make_engine(demo_model_dir).generate([chat(text)], SamplingParams(max_tokens=18, temperature=0, ignore_eos=True))
    outs = engine.generate([chat(text)], SamplingParams(max_tokens=18, temperature=0, ignore_eos=True, n=2))
    assert [o.token_ids for o in outs] == [alone.token_ids] * 2


def test_sampled_choices_differ_and_a_seed_reproduces_them(demo_model_dir: Path) -> None:
    messages = chat("Describe the chart.")
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True, n=3)
    first = [o.token_ids for o in make_engine(demo_model_dir).generate([messages], params)]
    again = [o.token_ids for o in make_engine(demo_model_dir).generate([messages], params)]
    assert first == again
    assert len({tuple(t) for t in first}) == 3
    # Choice i samples as a lone request with seed + i would.
    for i in range(3):
        one = SamplingParams(max_tokens=12, temperature=1.0, seed=5 + i, ignore_eos=True)
        [alone] = make_engine(demo_model_dir).generate([messages], one)
        assert alone.token_ids == first[i]


def test_choices_alongside_other_requests_and_stop_early(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir, chunk_size=32)
    reqs = [chat("First question about the map."), chat("Second one, about the invoice.", 1)]
    params = [SamplingParams(max_tokens=10, temperature=0, n=4), SamplingParams(max_tokens=6, temperature=0)]
    outs = engine.generate(reqs, params)
    assert len(outs) == 5
    ref = make_engine(demo_model_dir).generate(reqs, [SamplingParams(max_tokens=10, temperature=0), params[1]])
    assert all(o.token_ids == ref[0].token_ids for o in outs[:4]) and outs[4].token_ids == ref[1].token_ids
    assert engine.stats()["kv_blocks_used"] == 0
