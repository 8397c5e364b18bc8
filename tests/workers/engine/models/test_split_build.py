"""A model built for a split model worker (``--encoder-workers``: ``build(..., vision=False)``), for every family: no
vision parameter is allocated, loading reads no ``visual.*`` tensor of the checkpoint yet fills the language model
exactly as a full load does, and a call that would need the tower raises ``NoVisionTower``; the runner built so
reports no vision weights, warms up without a ViT call, and a plan that asks it to encode fails with the same clear
error."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from ipc.steps import EncodeItem, EncodeJob, StepPlan
from workers.engine.config import EngineConfig
from workers.engine.layers.linear import TPGroup
from workers.engine.models import family, load, load_spec
from workers.engine.models.base import NoVisionTower, VLModel
from workers.engine.runner.model_runner import ModelRunner
from workers.engine.runner.warmup import _warm_steps, warm_vision_attention

FIXTURES = ["demo_model_dir", "qwen3_model_dir", "qwen3_moe_model_dir", "qwen3_5_model_dir", "qwen3_5_moe_model_dir",
            "gemma4_model_dir", "gemma4_moe_model_dir"]


@pytest.fixture(params=FIXTURES)
def model_dir(request: pytest.FixtureRequest) -> Path:
    path: Path = request.getfixturevalue(request.param)
    return path


def _build(model_dir: Path, vision: bool) -> VLModel:
    spec = load_spec(model_dir)
    return family(spec.family).build(spec, TPGroup(), torch.float32, torch.device("cpu"), "sdpa", vision=vision)


def _loaded(model_dir: Path, vision: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[VLModel, list[str]]:
    """The model loaded from the checkpoint, and the names of every tensor the load read."""
    read: list[str] = []
    walk = load.iter_checkpoint

    def recorded(*args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in walk(*args, **kwargs):
            read.append(name)
            yield name, tensor

    with monkeypatch.context() as patch:
        patch.setattr(load, "iter_checkpoint", recorded)
        return load.load_model(_build(model_dir, vision), model_dir), read


def test_a_model_built_without_its_tower_holds_and_reads_no_vision_weight(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    split, read = _loaded(model_dir, False, monkeypatch)
    full, read_full = _loaded(model_dir, True, monkeypatch)
    assert split.vision is None and not split.has_vision
    assert not [n for n, _ in split.named_parameters() if not n.startswith("lm.")]
    assert any(n.startswith("vision.") for n, _ in full.named_parameters())
    visual = [n for n in read_full if load.normalize_name(n).startswith("visual.")]
    assert visual and not [n for n in read if load.normalize_name(n).startswith("visual.")]
    # The language model is loaded exactly as in the full model.
    want = full.lm.state_dict()
    got = split.lm.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(NoVisionTower, match="without its vision tower"):
        split.encode(torch.zeros(4, split.spec.patch_dim), [(1, 2, 2)])


def test_a_dummy_load_without_the_tower_fills_the_language_model_alike(demo_model_dir: Path) -> None:
    split = load.load_model(_build(demo_model_dir, False), demo_model_dir, load_format="dummy", seed=3)
    full = load.load_model(_build(demo_model_dir, True), demo_model_dir, load_format="dummy", seed=3)
    want = full.lm.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in split.lm.state_dict().items())


@pytest.fixture(scope="module")
def runners(demo_model_dir: Path) -> tuple[ModelRunner, ModelRunner]:
    """(the demo model's runner, the same without its tower: a split model worker's)."""
    cfg = EngineConfig(model=str(demo_model_dir), num_kv_blocks=16, max_model_len=512, chunk_size=64)
    full = ModelRunner(cfg, pixel_source=lambda item: torch.zeros(0))
    split = ModelRunner(replace(cfg, vision_tower=False), pixel_source=lambda item: torch.zeros(0))
    return full, split


def test_a_runner_without_its_tower_reports_no_vision_weights_and_refuses_to_encode(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    full, split = runners
    assert split.vision is None and split.vision_weight_bytes == 0
    assert full.vision_weight_bytes > 0 and split.weight_bytes == full.weight_bytes - full.vision_weight_bytes
    job = EncodeJob(b"k" * 16, [EncodeItem(b"k" * 16, (1, 4, 4), 4, None)])
    with pytest.raises(NoVisionTower, match="no vision tower"):
        split.execute(StepPlan(1, [], [], [], [job], []))


def test_the_warm_up_of_a_runner_without_its_tower_runs_no_vit(runners: tuple[ModelRunner, ModelRunner]) -> None:
    _, split = runners
    warm_vision_attention(split)  # nothing to warm
    patches, tokens = _warm_steps(split, frame_side=8, sizes=((112, 56),))
    assert patches == [] and tokens[0] == 16 * 16  # no ViT call; chunks from as many tokens as the blocks hold


def test_the_runner_gives_its_tower_the_configured_plan_budget(demo_model_dir: Path) -> None:
    cfg = EngineConfig(model=str(demo_model_dir), num_kv_blocks=16, max_model_len=512, chunk_size=64,
                       vit_plan_cache_mb=0.5)
    assert ModelRunner(cfg, pixel_source=lambda item: torch.zeros(0)).vision.call_plans.budget == 1 << 19
