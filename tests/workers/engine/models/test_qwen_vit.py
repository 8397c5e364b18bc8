"""The Qwen-style vision tower base (models/qwen_vit.py) on both families' towers, with dummy weights: the per-grid
plan memo's bound, the whole-call plans' byte budget, dummy weights, weight loading by name, the patch embedding as a matmul, and reading
``vision_config``. Each family's tower against transformers: test_qwen2_5_vision.py, test_qwen3_vision.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from workers.engine.layers.vit_plans import plan_bytes
from workers.engine.models.qwen2_5_vl import vision as qwen2_5
from workers.engine.models.qwen3_vl import vision as qwen3
from workers.engine.models.qwen_vit import QwenVisionTower, VisionPatchEmbed, activation, vision_fields

SMALL: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
FAMILIES: dict[str, tuple[Any, dict[str, Any], str]] = {  # vision module, extra config, its per-grid memo
    "qwen2_5_vl": (qwen2_5, dict(window_size=112, fullatt_block_indexes=[1]), "_grids"),
    "qwen3_vl": (qwen3, dict(num_position_embeddings=64, deepstack_visual_indexes=[0]), "_frames"),
}


def _tower(family: str) -> QwenVisionTower[Any]:
    module, extra, _ = FAMILIES[family]
    spec = module.VisionSpec.from_hf_config({"vision_config": {**SMALL, **extra}})
    tower: QwenVisionTower[Any] = module.build_vision(spec, dtype=torch.float32, device="cpu")
    tower.init_dummy(seed=0)
    return tower


def _pixels(tower: QwenVisionTower[Any], grid: tuple[int, int, int]) -> torch.Tensor:
    spec = tower.spec
    width = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2
    return torch.randn(grid[0] * grid[1] * grid[2], width, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grid_cache_is_bounded(family: str) -> None:
    tower = _tower(family)
    tower.grid_cache_size = 2
    tower.call_plans.resize(0)  # no whole-call plans kept: every call plans from the per-grid pieces
    with torch.no_grad():
        for g in [(1, 4, 4), (1, 4, 6), (1, 6, 4), (1, 4, 4)]:
            tower(_pixels(tower, g), [g])
    assert len(getattr(tower, FAMILIES[family][2])) == 2 and tower.stats["grid_misses"] == 4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_call_plans_stay_within_their_budget_and_a_smaller_one_drops_the_oldest(family: str) -> None:
    tower = _tower(family)
    calls = [[(1, 4, 4)], [(1, 4, 6)], [(1, 4, 4), (1, 6, 4)], [(1, 6, 6)]]
    with torch.no_grad():
        outs = [tower(torch.cat([_pixels(tower, g) for g in grids]), grids) for grids in calls]
    plans = tower.call_plans
    assert len(plans) == 4 and plans.bytes > 0
    sizes = [plan_bytes(plans.get((tuple(grids), torch.device("cpu")), _unbuilt)[0]) for grids in calls]
    assert plans.bytes == sum(sizes)
    plans.resize(sizes[2] + sizes[3])  # the two last used (get refreshed them in order) are what fits
    assert len(plans) == 2 and plans.bytes == sizes[2] + sizes[3]
    plans.resize(0)
    assert len(plans) == 0 and plans.bytes == 0
    with torch.no_grad():  # nothing kept, the same answers: a plan is rebuilt per call
        again = tower(torch.cat([_pixels(tower, g) for g in calls[2]]), calls[2])
    assert len(plans) == 0 and torch.equal(again, outs[2])


def _unbuilt() -> Any:
    raise AssertionError("a kept plan was asked for and not found")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dummy_weights_are_deterministic_and_load_back_by_name(family: str) -> None:
    tower, again = _tower(family), _tower(family)
    state = tower.state_dict()
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in state.items())
    assert state["blocks.0.attn.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.2)
    assert state["blocks.0.norm1.weight"].eq(1).all() and state["blocks.0.attn.qkv.bias"].eq(0).all()
    fresh = _tower(family)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    assert fresh.load_weights(state.items()) == set(dict(tower.named_parameters()))
    grid = (1, 4, 6)
    with torch.no_grad():
        assert torch.equal(fresh(_pixels(tower, grid), [grid]), tower(_pixels(tower, grid), [grid]))
    del state["blocks.1.attn.proj.bias"]
    with pytest.raises(ValueError, match=r"missing \['blocks\.1\.attn\.proj\.bias'\] \(1\)"):
        fresh.load_weights(state.items())


@pytest.mark.parametrize("bias", [False, True], ids=["qwen2_5_vl", "qwen3_vl"])
def test_patch_embed_matmul_equals_conv3d(bias: bool) -> None:
    spec = qwen3.VisionSpec(**SMALL)
    embed = VisionPatchEmbed(spec, bias=bias)
    for p in embed.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    pixels = torch.randn(7, 3 * 2 * 16 * 16)
    with torch.no_grad():
        ref = embed.proj(pixels.view(-1, 3, 2, 16, 16)).view(7, -1)
        torch.testing.assert_close(embed(pixels), ref, atol=1e-5, rtol=1e-5)


def test_vision_config_fields_aliases_and_activations() -> None:
    cfg = {
        "vision_config": {
            "num_hidden_layers": 3,  # an alias, filling depth
            "fullatt_block_indexes": [0, 2],
            "rope_parameters": {"rope_theta": 5.0},  # where transformers 5 nests it
            "unknown_field": 1,
        }
    }
    kw = vision_fields(cfg, qwen2_5.VisionSpec, {"num_hidden_layers": "depth"})
    assert kw == {"fullatt_block_indexes": (0, 2), "depth": 3, "rope_theta": 5.0}
    assert vision_fields({"depth": 2, "num_hidden_layers": 9}, qwen3.VisionSpec, {"num_hidden_layers": "depth"}) == {
        "depth": 2  # the field's own name wins over its alias
    }
    assert activation("silu") is F.silu
    with pytest.raises(ValueError, match="not supported"):
        activation("gelu_new")  # a Python formula in transformers, not this torch op
