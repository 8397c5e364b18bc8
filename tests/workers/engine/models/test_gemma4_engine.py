"""Gemma 4 dense and MoE through the offline Engine: greedy tokens equal transformers' generate on the demo checkpoints
(CPU, float32; sliding window 64, so every prompt with an image passes it) for text, one image, five images of odd
aspect ratios in chunks that would cut them (the scheduler keeps each image's span whole), a multi-turn chat whose
context passes the window many times and hits the prefix cache every turn, n > 1 and caches too small for the load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ipc.prompts import SamplingParams
from tests.conftest import noise_image
from tests.workers.engine.models.engine_harness import FIVE, GREEDY, MAX_NEW, Reference, chat, make_engine


@pytest.fixture(scope="module", params=["dense", "moe"])
def family(request: pytest.FixtureRequest) -> tuple[Path, Reference]:
    model_dir: Path = request.getfixturevalue("gemma4_moe_model_dir" if request.param == "moe" else "gemma4_model_dir")
    return model_dir, Reference(model_dir)


def test_spec(gemma4_model_dir: Path) -> None:
    engine = make_engine(gemma4_model_dir)
    spec = engine.runner.spec
    assert spec.family == "gemma4" and spec.bidirectional_images and spec.kv_shapes is not None
    # The global layers' caches are wider than the sliding layers' (another head dim), each allocated at its shape.
    assert len({shape for shape in spec.kv_shapes}) == 2
    assert [tuple(c.shape[-2:]) for c in engine.runner.kv_caches] == list(spec.kv_shapes)


def test_text_longer_than_the_window(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    text = " ".join(f"Line {i} of the report says the value went up." for i in range(12))
    messages = [{"role": "user", "content": text}]
    [out] = make_engine(model_dir, chunk_size=32).generate([messages], GREEDY)
    assert out.prompt_tokens > 2 * 64
    assert out.token_ids == reference.generate(messages)


def test_one_image(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    messages = chat("What is in this picture?", [noise_image(300, 200, seed=42)])
    [out] = make_engine(model_dir).generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_five_odd_images_with_chunks_smaller_than_an_image(family: tuple[Path, Reference], chunk_size: int) -> None:
    """Chunks of 16 and 64 tokens would cut every image (up to 280 tokens); the scheduler ends a chunk before an image
    or takes the image whole, so each image's tokens see each other both ways as in transformers."""
    model_dir, reference = family
    messages = chat("Compare these five pages.", FIVE)
    engine = make_engine(model_dir, chunk_size=chunk_size)
    steps: list[int] = []
    core = engine.core
    schedule = core.schedule

    def record(*args: Any, **kwargs: Any) -> Any:
        plan = schedule(*args, **kwargs)
        if plan is not None:
            steps.extend(c.length for c in plan.chunks)
        return plan

    core.schedule = record  # type: ignore[method-assign]
    [out] = engine.generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)
    assert engine.stats()["images_encoded"] == 5
    assert max(steps) > chunk_size  # an image's span went in whole, past the budget


def test_multi_turn_chat_past_the_window_hits_the_prefix_cache(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    engine = make_engine(model_dir, chunk_size=64)
    messages: list[dict[str, Any]] = []
    previous = 0  # the last turn's prompt tokens
    for turn in range(3):
        messages.append(chat(f"Page {turn}: what changed?", [FIVE[turn]])[0])
        before = engine.stats()
        [out] = engine.generate([messages], GREEDY)
        assert out.token_ids == reference.generate(messages), turn
        after = engine.stats()
        assert after["images_encoded"] == turn + 1  # each image once, however often it is resent
        if turn:
            hit = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
            assert hit >= previous - 16, (turn, hit, previous)
        previous = out.prompt_tokens
        messages.append({"role": "assistant", "content": out.text})
    assert previous > 64 * 4


def test_two_choices(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    messages = chat("Name two colours.", [FIVE[0]])
    outs = make_engine(model_dir).generate([messages], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, n=2))
    expected = reference.generate(messages)
    assert [o.token_ids for o in outs] == [expected, expected]


def test_small_caches_stay_exact(family: tuple[Path, Reference]) -> None:
    """An embedding cache smaller than one request and a KV cache that preempts: every answer is still transformers'."""
    model_dir, reference = family
    conversations = [chat(f"Question {i}.", FIVE[i : i + 2]) for i in range(3)]
    engine = make_engine(model_dir, chunk_size=32, mm_cache_mb=0.02, num_kv_blocks=48)
    outs = engine.generate(conversations, GREEDY)
    for messages, out in zip(conversations, outs, strict=True):
        assert out.token_ids == reference.generate(messages)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_window_pool_just_above_one_sequence_stays_exact(family: tuple[Path, Reference], ahead: bool) -> None:
    """The sliding layers' pool holds little more than one sequence's window and chunk (64 + 32 tokens in blocks of
    16: 7 blocks) while three long prompts run: blocks fall out of the windows, go back and serve the next sequence,
    and every answer is still transformers'. ``ahead``: asynchronous scheduling, which releases blocks the step in
    flight still reads (handed out again only in the step after it)."""
    model_dir, reference = family
    prompts = [
        [{"role": "user", "content": " ".join(f"Item {i} of list {k} reads {i * k}." for i in range(25))}]
        for k in range(3)
    ]
    engine = make_engine(model_dir, chunk_size=32, num_window_blocks=9)
    engine.async_scheduling = ahead
    outs = engine.generate(prompts, GREEDY)
    for messages, out in zip(prompts, outs, strict=True):
        assert out.prompt_tokens > 4 * 64
        assert out.token_ids == reference.generate(messages)
    stats = engine.stats()
    assert stats["window_blocks_total"] == 9 and stats["window_blocks_used"] == 0
    # Each prompt alone passes through 16+ blocks: blocks were released and handed out again many times over.
    assert stats["window_blocks_released"] > 3 * 9
    # Each pool has one scratch block past the scheduler's count: the sliding caches 9 + 1, the global ones 512 + 1.
    windows = engine.runner.spec.kv_windows
    assert windows is not None and any(windows) and not all(windows)
    assert [c.shape[1] for c in engine.runner.kv_caches] == [10 if w else 513 for w in windows]


def test_a_small_window_pool_in_a_multi_turn_chat_with_images(family: tuple[Path, Reference]) -> None:
    """A chat past the window over a pool just above what one turn needs (the window and a whole image's span):
    recycled window blocks shrink the prefix hits, and the answers stay transformers'."""
    model_dir, reference = family
    engine = make_engine(model_dir, chunk_size=64, num_window_blocks=28)
    messages: list[dict[str, Any]] = []
    for turn in range(3):
        messages.append(chat(f"Page {turn}: what changed?", [FIVE[turn]])[0])
        [out] = engine.generate([messages], GREEDY)
        assert out.token_ids == reference.generate(messages), turn
        messages.append({"role": "assistant", "content": out.text})
    stats = engine.stats()
    assert stats["window_blocks_released"] > 0 and stats["prefix_cache_hit_tokens"] > 0
