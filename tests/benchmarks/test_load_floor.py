"""load_floor's inputs from transformers' own model classes and image processors: every weight lands in one role,
the layer and tower patterns match the configs, and a 1080p image has the patches the harness's prompts show."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from benchmarks.tools.load_floor import Load, build, floor_of, patches_per_image


def test_every_weight_of_a_moe_shape_has_one_role(tmp_path: Path) -> None:
    params, shape, ckpt = build("qwen3.5-35b-a3b", 4, tmp_path)
    config = AutoConfig.from_pretrained(str(ckpt))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    skipped = sum(p.numel() for n, p in model.named_parameters()
                  if p.ndim < 2 or "embed_tokens" in n or "pos_embed" in n)  # fmt: skip
    counted = params.lm_dense + params.lm_experts + params.lm_head + params.vision_per_patch + params.vision_per_token
    assert counted + skipped == sum(p.numel() for p in model.parameters())
    text = config.text_config
    assert params.experts_active == text.num_experts_per_tok / text.num_experts
    assert params.lm_experts > 10 * params.lm_dense  # the routed experts are most of a layer's weights
    assert (shape.full_layers, shape.gdn_layers) == (1, 3)  # every 4th layer attends fully
    assert shape.vision_full_blocks == shape.vision_depth and shape.window_patches == 0


def test_qwen2_5_vl_windows_and_the_1080p_patches(tmp_path: Path) -> None:
    params, shape, ckpt = build("7b", 2, tmp_path)
    assert (shape.vision_full_blocks, shape.vision_depth) == (4, 32)
    assert shape.window_patches == 64  # 112-pixel windows of 14-pixel patches
    assert params.lm_experts == 0 and params.experts_active == 0
    assert patches_per_image(ckpt, (1920, 1080)) == 78 * 138  # the processor's 1,092 x 1,932 resize


@pytest.mark.parametrize("shape_name", ["qwen3-8b", "qwen3.5-9b"])
def test_a_1080p_image_is_2040_tokens_and_the_floor_grows_with_the_load(shape_name: str, tmp_path: Path) -> None:
    params, shape, ckpt = build(shape_name, 4, tmp_path)
    patches = patches_per_image(ckpt, (1920, 1080))
    assert patches // shape.merge**2 == 2040  # the harness's (b) prompt: 2,135 tokens with its text
    one = floor_of(params, shape, Load(64, 1, patches, 2040, 95, 128))
    two = floor_of(params, shape, Load(128, 1, patches, 2040, 95, 128))
    assert two.lm_gemm == pytest.approx(2 * one.lm_gemm) and two.vision_attn == pytest.approx(2 * one.vision_attn)
    assert two.tail_bytes == one.tail_bytes  # the last request's decode reads the same weights
    s = one.seconds(790, 500, 4.0)
    assert s["floor"] == pytest.approx(sum(v for k, v in s.items() if k != "floor"))
