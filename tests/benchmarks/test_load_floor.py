"""load_floor's inputs from transformers' own model classes and image processors: every weight lands in one role,
the layer and tower patterns match the configs, and a 1080p image has the patches the harness's prompts show."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from benchmarks.tools.load_floor import (
    TAIL,
    TRACED,
    Load,
    build,
    floor_of,
    patches_per_image,
    trace_parts,
    trace_report,
)
from benchmarks.tools.step_trace import load as load_trace


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


TRACE = Path(__file__).parent / "fixtures" / "trace-qwen3.5-9b-b"  # (b) on the 9B, H200, 2026-12-03 (step records)


def test_a_traced_burst_splits_into_the_floors_parts() -> None:
    """The records of a served (b) (64 requests, 128 tokens out): the tail is the 127 decode-only steps after the last
    step that carried prompt tokens, the tower's time is every step's ViT phase, and the parts fill the window."""
    spent = trace_parts(TRACE, 64)
    records = load_trace(TRACE)
    submits = sorted(r["t"] for r in records["frontend"] if r["kind"] == "submit")
    steps = [r for r in records["worker0"] if r["kind"] == "step"]
    assert spent["window"] == pytest.approx(steps[-1]["end"] - submits[0])
    tail_steps = [s for s in steps if s["start"] >= steps[-1]["end"] - spent[TAIL]]
    assert len(tail_steps) == 127 and all(s["tokens"] == s["decodes"] for s in tail_steps)
    assert spent["vision tower"] == pytest.approx(sum(s.get("vit", 0.0) for s in steps))
    prompt = [s for s in steps if s["tokens"] > s["decodes"]]
    assert spent["LM prefill"] == pytest.approx(sum(s["forward"] for s in prompt))
    assert sum(spent[part] for part in TRACED) == pytest.approx(spent["window"])
    assert spent["the rest"] > 0  # host phases and the decode-only steps between prefills


def test_a_trace_of_fewer_requests_than_the_load_is_refused() -> None:
    with pytest.raises(SystemExit, match="fewer than --requests 65"):
        trace_parts(TRACE, 65)


def test_the_trace_table_rates_each_part_against_its_floor(tmp_path: Path) -> None:
    params, shape, ckpt = build("qwen3.5-9b", 4, tmp_path)
    floor = floor_of(params, shape, Load(64, 1, patches_per_image(ckpt, (1920, 1080)), 2040, 95, 128))
    s = floor.seconds(854, 500, 4.0, vit_attn_tflops=353)
    assert s["vision attention"] == pytest.approx(floor.vision_attn / 353e12)  # the tower's own rate
    assert s["LM attention and recurrence"] == pytest.approx(floor.lm_attn / 500e12)
    table = trace_report(s, trace_parts(TRACE, 64))
    tower = next(line for line in table.splitlines() if line.startswith("| vision tower |"))
    want = (s["vision projections"] + s["vision attention"]) / trace_parts(TRACE, 64)["vision tower"]
    assert tower.endswith(f"| {want:.2f} |")


def test_fp8_lm_rates_price_only_the_lm_and_keep_lm_head_bf16(tmp_path: Path) -> None:
    """An FP8 checkpoint's floor: the LM projections at their own rate and one byte a weight in the tail, the tower
    (bf16 under issue 37) and lm_head (kept bf16 by both formats) as before."""
    params, shape, ckpt = build("qwen3-8b", 4, tmp_path)
    load = Load(64, 1, patches_per_image(ckpt, (1920, 1080)), 2040, 95, 128)
    bf16, fp8 = floor_of(params, shape, load), floor_of(params, shape, load, 1.0)
    per_token = params.lm_dense + params.lm_experts * params.experts_active
    assert bf16.tail_bytes - fp8.tail_bytes == pytest.approx(per_token)
    a, b = bf16.seconds(790, 500, 4.0), fp8.seconds(790, 500, 4.0, lm_gemm_tflops=1150)
    assert b["LM projections"] == pytest.approx(a["LM projections"] * 790 / 1150)
    for part in ("vision projections", "vision attention", "LM attention and recurrence"):
        assert b[part] == a[part]
    assert 1.0 < a["floor"] / b["floor"] < 1150 / 790
