"""Qwen3.5 dense and MoE (hybrid: Gated DeltaNet layers beside full attention) through the offline Engine: greedy
tokens equal transformers' generate on the demo checkpoints (CPU, float32) with the recurrent state carried across
chunks that cut images, prefix hits resumed from state snapshots (inside an image, and every turn of a chat that
resends its images), n > 1 choices forked with a copy of the state, and pools too small for the load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ipc.prompts import SamplingParams
from tests.conftest import noise_image
from tests.videos import VideoReference, make_video, video_chat
from tests.workers.engine.models.engine_harness import FIVE, GREEDY, MAX_NEW, Reference, chat, make_engine


@pytest.fixture(scope="module", params=["dense", "moe"])
def family(request: pytest.FixtureRequest) -> tuple[Path, Reference]:
    model_dir: Path = request.getfixturevalue("qwen3_5_moe_model_dir" if request.param == "moe" else "qwen3_5_model_dir")
    return model_dir, Reference(model_dir)


def test_spec_is_hybrid(qwen3_5_model_dir: Path) -> None:
    engine = make_engine(qwen3_5_model_dir)
    spec = engine.runner.spec
    assert spec.recurrent is not None and 0 < spec.recurrent.num_layers < spec.num_layers
    assert len(engine.runner.kv_caches) == spec.kv_layers == spec.num_layers - spec.recurrent.num_layers
    assert engine.stats()["state_slots_total"] == engine.runner.num_state_slots > 0


def test_text_only(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    messages = [{"role": "user", "content": "Describe the chart on page three."}]
    [out] = make_engine(model_dir).generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)


def test_one_image(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    messages = chat("What is in this picture?", [noise_image(300, 200, seed=42)])
    [out] = make_engine(model_dir).generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_five_odd_images_in_chunks_that_cut_the_state_mid_image(family: tuple[Path, Reference], chunk_size: int) -> None:
    model_dir, reference = family
    messages = chat("Compare these five pages.", FIVE)
    engine = make_engine(model_dir, chunk_size=chunk_size)
    [out] = engine.generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)
    assert engine.stats()["images_encoded"] == 5


def test_video(qwen3_5_model_dir: Path) -> None:
    reference = VideoReference(qwen3_5_model_dir)
    messages = video_chat("What happens in the video?", [make_video(frames=37, width=206, height=118, fps=10)])
    [out] = make_engine(qwen3_5_model_dir, chunk_size=13).generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages, MAX_NEW)


def test_prefix_ending_inside_an_image_resumes_from_a_state_snapshot(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    engine = make_engine(model_dir, chunk_size=32, state_snapshot_every=1)
    first = chat("One.", [FIVE[1]])
    engine.generate([first], GREEDY)
    encoded = engine.stats()["images_encoded"]
    second = chat("Two.", [FIVE[1]])
    [out] = engine.generate([second], GREEDY)
    assert out.token_ids == reference.generate(second)
    stats = engine.stats()
    proc = engine.processor
    [span] = proc.build(proc.render(second), [proc.process_image(FIVE[1])]).spans
    skipped = stats["state_restored_tokens"]
    assert stats["state_restores"] == 1
    assert skipped == stats["prefix_cache_hit_tokens"] and skipped % 16 == 0
    assert span.offset < skipped < span.offset + span.length  # the snapshot sits inside the image
    assert stats["images_encoded"] == encoded  # its tail came from the embedding cache


def test_four_turn_chat_resending_its_images_hits_every_turn(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    engine = make_engine(model_dir, chunk_size=64)
    messages: list[dict[str, Any]] = []
    previous = 0  # the last turn's prompt tokens
    for turn in range(4):
        messages.append(chat(f"Page {turn}: what changed?", [FIVE[turn]])[0])
        before = engine.stats()
        [out] = engine.generate([messages], GREEDY)
        assert out.token_ids == reference.generate(messages), turn
        after = engine.stats()
        assert after["images_encoded"] == turn + 1  # each image once, however often it is resent
        if turn:
            # Resumed from the snapshot at the last full block of the turn before's prompt: all of it but its
            # last partial block (and that turn's answer) is skipped.
            assert after["state_restores"] == before["state_restores"] + 1
            resent = after["state_restored_tokens"] - before["state_restored_tokens"]
            assert previous - 16 <= resent < previous, (turn, resent, previous)
        previous = out.prompt_tokens
        messages.append({"role": "assistant", "content": out.text})


def test_two_choices_fork_the_state(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    messages = chat("Name two colours.", [FIVE[0]])
    engine = make_engine(model_dir)
    outs = engine.generate([messages], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, n=2))
    expected = reference.generate(messages)
    assert [o.token_ids for o in outs] == [expected, expected]
    assert engine.stats()["state_slots_live"] == 0


def test_small_pools_and_caches_stay_exact(family: tuple[Path, Reference]) -> None:
    """Two live state slots for four requests (the others wait), an embedding cache smaller than one request, and a
    KV cache that preempts: every answer is still transformers'."""
    model_dir, reference = family
    conversations = [chat(f"Question {i}.", FIVE[i : i + 2]) for i in range(4)]
    engine = make_engine(model_dir, chunk_size=32, state_slots=2, mm_cache_mb=0.02, num_kv_blocks=40)
    outs = engine.generate(conversations, GREEDY)
    for messages, out in zip(conversations, outs, strict=True):
        assert out.token_ids == reference.generate(messages)
    assert engine.stats()["state_slots_live"] == 0
