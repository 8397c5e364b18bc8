"""The model worker's start-up warm-up of its largest step (run on CUDA before "ready"): it must leave nothing behind
that changes an answer, though it writes KV into blocks that later hold real sequences."""

from __future__ import annotations

from pathlib import Path

from tests.workers.engine.test_engine import FIVE, GREEDY, Reference, chat, make_engine, reference  # noqa: F401
from workers.engine.warmup import _warm_steps


def test_largest_step_leaves_every_answer_as_transformers_gives_it(demo_model_dir: Path, reference: Reference) -> None:  # noqa: F811
    engine = make_engine(demo_model_dir, chunk_size=64, vit_max_patches=200)
    runner = engine.runner
    before = runner.model.vision.stats["calls"]
    patches, tokens = _warm_steps(runner, frame_side=8)
    # vit_max_patches 200 holds three 8 x 8 frames, then shares of that down to one 4 x 4 frame (repeats run once); the chunks go from
    # the step budget down, each with image rows first
    assert patches == [192, 128, 64, 16] and tokens == [64, 48, 32, 21, 16, 8, 4]
    assert runner.model.vision.stats["calls"] == before + len(patches)
    assert runner.kv_caches[0][:4].abs().sum() > 0  # the chunk's KV went into blocks 0-3, which requests get next
    first = chat("Compare these five pages.", FIVE)
    [out] = engine.generate([first], GREEDY)
    assert out.token_ids == reference.generate(first)
    again = chat("And now just these two.", FIVE[1:3])  # prefix cache and embedding cache in play after the warm-up
    [out] = engine.generate([again], GREEDY)
    assert out.token_ids == reference.generate(again)
