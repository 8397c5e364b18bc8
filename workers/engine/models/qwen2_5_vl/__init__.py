"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): windowed-attention ViT with 14 px patches, plain
M-RoPE, Qwen2 decoder with q/k/v bias."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from workers.engine.models.base import ModelFamily, builder, tower_builder
from workers.engine.models.model_spec import ModelSpec, VideoTiming, spec_from
from workers.engine.models.qwen2_5_vl.lm import TextSpec, build_language_model
from workers.engine.models.qwen2_5_vl.vision import VisionSpec, build_vision
from workers.engine.models.video_mrope import video_mrope_delta, video_mrope_positions


def parse(cfg: dict[str, Any], model_dir: Path) -> ModelSpec:
    text, vision = TextSpec.from_hf_config(cfg), VisionSpec.from_hf_config(cfg)
    return spec_from("qwen2_5_vl", cfg, model_dir, text, vision, embed_width=vision.out_hidden_size)


build = builder(build_language_model, build_vision)


def video_layout(spec: ModelSpec, timing: VideoTiming, tokens: tuple[str, str, str]) -> tuple[str, list[int]]:
    """A video is one run of frame groups (the template wraps it in vision_start/end); group g sits at
    temporal position trunc(g * tokens_per_second * second_per_grid_t), second_per_grid_t being the time one
    group of sampled frames spans. The arithmetic is float32, as transformers' processor hands
    ``second_per_grid_ts`` to ``get_rope_index`` in a float32 tensor: a float64 product truncates differently
    for some frame rates."""
    sampled_fps = len(timing.frames_indices) / timing.total_frames * timing.fps
    interval = np.float32(spec.vision.tokens_per_second) * np.float32(timing.temporal_patch / sampled_fps)
    groups = timing.num_groups
    return tokens[0] * groups, [int(np.float32(g) * interval) for g in range(groups)]


def write_demo(out: Path, variant: str) -> Path:
    from workers.engine.models.qwen2_5_vl.demo import write_demo as write

    return write(out, variant)


FAMILY = ModelFamily(
    name="qwen2_5_vl",
    parse=parse,
    build=build,
    positions=video_mrope_positions,
    delta=video_mrope_delta,
    write_demo=write_demo,
    description="Qwen2.5-VL 3B / 7B / 32B / 72B",
    video_layout=video_layout,
    build_tower=tower_builder(build_vision),
)
