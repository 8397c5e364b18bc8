"""The start-up warm-up of a hybrid model's state-snapshot paths (run on CUDA before "ready"): it must take
snapshots both on whole fla chunks and off them, touch no state slot but the scratch one, and change no answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers.engine.models.engine_harness import FIVE, GREEDY, Reference, chat, make_engine
from workers.engine.kernels import gated_delta_fla
from workers.engine.runner.warmup import warm_state_snapshots


def test_snapshot_warmup_takes_both_paths_in_the_scratch_slot_only(qwen3_5_model_dir: Path) -> None:
    engine = make_engine(qwen3_5_model_dir, chunk_size=64)
    runner = engine.runner
    assert runner.state is not None
    scratch = runner.state.scratch
    before = [pool.clone() for pool in runner.state.pools]
    chunks = warm_state_snapshots(runner)
    # inside-chunk snapshots (not at the chunk's end) on whole fla chunks in the first chunk, off them in the second
    inside = [[n for n in offsets if n < query] for query, _, offsets in chunks]
    assert len(chunks) == 2 and all(inside)
    assert all(n % gated_delta_fla.CHUNK == 0 for n in inside[0])
    assert any(n % gated_delta_fla.CHUNK for n in inside[1])
    assert chunks[1][1] > chunks[1][0]  # the second chunk resumes from the first's state
    for was, pool in zip(before, runner.state.pools, strict=True):
        assert not torch.equal(was[scratch], pool[scratch])  # the warm-up ran the layers
        assert torch.equal(was[:scratch], pool[:scratch])  # and left every slot a sequence can own as it was
    reference = Reference(qwen3_5_model_dir)
    messages = chat("Compare these five pages.", FIVE)
    [out] = engine.generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)


def test_a_model_without_linear_attention_has_nothing_to_warm(demo_model_dir: Path) -> None:
    assert warm_state_snapshots(make_engine(demo_model_dir).runner) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_engine_has_checked_fla_kept_states_before_its_first_request(qwen3_5_model_dir: Path) -> None:
    """The kept-chunk-states path (and its one-time check) ran during start-up, not at the first snapshot under load."""
    if not gated_delta_fla.available():
        pytest.skip("flash-linear-attention is not installed")
    gated_delta_fla._states = None  # as in a fresh process
    make_engine(qwen3_5_model_dir, device="cuda", dtype="bfloat16")
    assert gated_delta_fla._states not in (None, False)
