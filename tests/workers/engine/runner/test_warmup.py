"""The model worker's start-up warm-up of its largest step (run on CUDA before "ready"): it must leave nothing behind
that changes an answer, though it writes KV into blocks that later hold real sequences."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.workers.engine.test_offline import FIVE, GREEDY, Reference, chat, make_engine, reference  # noqa: F401
from workers.engine.kernels import gated_delta, gated_delta_fla, skinny_tune
from workers.engine.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from workers.engine.models.model_spec import RecurrentSpec
from workers.engine.runner.warmup import (
    TUNE_TOKENS,
    _warm_steps,
    size_grid,
    tune_linear_attention,
    tune_skinny,
)


def test_largest_step_leaves_every_answer_as_transformers_gives_it(demo_model_dir: Path, reference: Reference) -> None:  # noqa: F811
    engine = make_engine(demo_model_dir, chunk_size=64, vit_max_patches=200)
    runner = engine.runner
    before = runner.model.vision.stats["calls"]
    patches, tokens = _warm_steps(runner, frame_side=8, sizes=((112, 56), (60, 30)))
    # vit_max_patches 200 holds three 8 x 8 frames, then shares of that down to one 4 x 4 frame; a 112 x 56 image is
    # 8 x 4 patches of 14 px (32), run 1, 2, 3 and 6 to a call; 60 x 30 rounds to 56 x 28 px (8 patches, 1, 2, 3 and 25 to a call). Largest first,
    # a repeated count once. The chunks go from the step budget down by 0.9 to a sixteenth of it, image rows first.
    assert [size_grid(112, 56, 14, 2), size_grid(60, 30, 14, 2)] == [(1, 4, 8), (1, 2, 4)]
    assert patches == [200, 192, 128, 96, 64, 32, 24, 16, 8]
    assert tokens == [64, 57, 51, 46, 41, 37, 34, 30, 27, 24, 22, 20, 18, 16, 14, 13, 11, 10, 9, 8, 7, 6, 5, 4]
    assert runner.model.vision.stats["calls"] == before + len(patches)
    assert runner.kv_caches[0][:4].abs().sum() > 0  # the chunk's KV went into blocks 0-3, which requests get next
    first = chat("Compare these five pages.", FIVE)
    [out] = engine.generate([first], GREEDY)
    assert out.token_ids == reference.generate(first)
    again = chat("And now just these two.", FIVE[1:3])  # prefix cache and embedding cache in play after the warm-up
    [out] = engine.generate([again], GREEDY)
    assert out.token_ids == reference.generate(again)


def test_skinny_tiles_are_measured_on_every_lm_projection(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The start-up measurement (CUDA only; here its timer is not reached) is handed each projection of the LM and
    # its head once, in the served dtype, and nothing of the vision tower; GLIMPSE_SKINNY_TUNE=0 skips it.
    engine = make_engine(demo_model_dir, chunk_size=64)
    runner = engine.runner
    seen: list[list[torch.Tensor]] = []

    def tune(weights: list[torch.Tensor], key: str, sms: int) -> dict[tuple[int, int], object]:
        seen.append(list(weights))
        return {}

    monkeypatch.setattr(skinny_tune, "tune", tune)
    monkeypatch.setattr(skinny_tune, "cache_key", lambda device, dtype: "key")
    tune_skinny(runner)
    [weights] = seen
    lm = runner.model.lm
    expected = [m.weight for m in lm.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))]
    assert len(expected) > 4 * len(lm.layers) and [id(w) for w in weights] == [id(w) for w in expected]
    assert any(w is lm.lm_head.weight for w in weights) and all(w.dtype == runner.dtype for w in weights)
    tower = {id(p) for p in runner.model.vision.parameters()}
    assert not any(id(w) in tower for w in weights)
    monkeypatch.setenv(skinny_tune.ENV, "0")
    tune_skinny(runner)
    assert len(seen) == 1


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_sites_run_the_tower_on_its_own_thread_at_tp_1(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch, tp: int
) -> None:
    # The tower's three compile calls run on a thread beside the LM's (their compiles overlap on an empty kernel
    # cache) in inference mode, as the warm-up's own thread is; at TP > 1 inline, so a rank's collectives keep one
    # order. The LM's three sizes and the head stay on the calling thread either way.
    import dataclasses
    import threading

    from workers.engine.runner import warmup

    engine = make_engine(demo_model_dir, chunk_size=64)
    runner = engine.runner
    monkeypatch.setattr(runner, "tp", dataclasses.replace(runner.tp, size=tp))
    calls: list[tuple[str, str, bool]] = []
    encode, forward = runner.model.encode, runner.model.forward

    def record(kind: str, fn):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append((kind, threading.current_thread().name, torch.is_inference_mode_enabled()))
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(runner.model, "encode", record("tower", encode))
    monkeypatch.setattr(runner.model, "forward", record("lm", forward))
    main = threading.current_thread().name
    with torch.inference_mode():
        warmup._run_every_fused_site(runner)
    tower = [c for c in calls if c[0] == "tower"]
    assert len(tower) == len(warmup.fused_grids(runner.merge)) == 3
    assert all(name.startswith("warm-tower") if tp == 1 else name == main for _, name, _ in tower)
    assert [c[1] for c in calls if c[0] == "lm"] == [main] * 3
    assert all(inference for _, _, inference in calls)


def test_fla_is_first_called_on_a_prefill_chunk_of_this_ranks_heads(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    # fla times each autotune on its first call at a shape: the warm-up makes that a served chunk's size (up to
    # TUNE_TOKENS) at the rank's share of the linear-attention heads, before its few-token calls; a failure only
    # logs. (CUDA with fla-core: the call itself, tests/workers/engine/kernels/test_fla_tuning.py.)
    calls: list[tuple[object, ...]] = []

    def tune_shape(*args: object, tokens: int, device: torch.device) -> bool:
        calls.append((*args, tokens, device))
        return True

    monkeypatch.setattr(gated_delta, "fla_path", lambda device: True)
    monkeypatch.setattr(gated_delta_fla, "tune_shape", tune_shape)
    recurrent = RecurrentSpec(num_layers=3, num_key_heads=16, num_value_heads=48, key_head_dim=128, value_head_dim=64,
                              conv_kernel=4)  # fmt: skip
    device = torch.device("cpu")

    def runner(tp: int, chunk: int, spec: RecurrentSpec | None = recurrent) -> Any:
        return SimpleNamespace(spec=SimpleNamespace(recurrent=spec), tp=SimpleNamespace(size=tp),
                               cfg=SimpleNamespace(chunk_size=chunk), dtype=torch.bfloat16, device=device)  # fmt: skip

    tune_linear_attention(runner(2, 2048))
    tune_linear_attention(runner(1, 8192))
    tune_linear_attention(runner(1, 8192, spec=None))  # no linear-attention layers: nothing to tune
    assert calls == [(8, 24, 128, 64, torch.bfloat16, 2048, device), (16, 48, 128, 64, torch.bfloat16, TUNE_TOKENS, device)]

    def fails(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("no kernel")

    monkeypatch.setattr(gated_delta_fla, "tune_shape", fails)
    tune_linear_attention(runner(1, 4096))
    assert "not tuned on a prefill chunk (no kernel)" in caplog.text
