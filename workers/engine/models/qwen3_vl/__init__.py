"""Qwen3-VL, dense (``Qwen3VLForConditionalGeneration``) and MoE (``Qwen3VLMoeForConditionalGeneration``):
ViT with 16 px patches, a learned position table interpolated to each grid and DeepStack features from
intermediate blocks; Qwen3 decoder (per-head q/k RMSNorm, no QKV bias) with interleaved M-RoPE, dense or with
routed experts.

DeepStack rows travel with the image: the vision tower returns [tokens, hidden * (1 + levels)] (main embedding,
then each level), the embedding cache stores that whole row, and the LM adds level i to the image tokens'
hidden states after decoder layer i."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.engine.models.base import ModelFamily, builder, tower_builder
from workers.engine.models.model_spec import ModelSpec, VideoTiming, spec_from
from workers.engine.models.mrope import mrope_delta, mrope_positions
from workers.engine.models.qwen3_vl.lm import TextSpec, build_language_model
from workers.engine.models.qwen3_vl.vision import VisionSpec, build_vision


def parse(cfg: dict[str, Any], model_dir: Path) -> ModelSpec:
    text, vision = TextSpec.from_hf_config(cfg), VisionSpec.from_hf_config(cfg)
    if vision.out_hidden_size != text.hidden_size:
        raise ValueError(
            f"vision out_hidden_size {vision.out_hidden_size} != text hidden_size {text.hidden_size}"
        )
    levels = len(vision.deepstack_visual_indexes)
    if levels > text.num_hidden_layers:
        raise ValueError(f"{levels} DeepStack levels but only {text.num_hidden_layers} decoder layers")
    return spec_from(
        "qwen3_vl", cfg, model_dir, text, vision, embed_width=vision.out_hidden_size * (1 + levels)
    )


build = builder(build_language_model, build_vision)


def video_layout(spec: ModelSpec, timing: VideoTiming, tokens: tuple[str, str, str]) -> tuple[str, list[int]]:
    """Each frame group is its own vision block, preceded by the time it shows as text: the mean of its first
    and last frame's timestamps, one decimal (``<1.5 seconds>``), the last group padded with its last frame as
    the processor pads it. Groups then take positions like images; no temporal offsets."""
    pad, start, end = tokens
    merge = timing.temporal_patch
    indices = list(timing.frames_indices)
    indices += [indices[-1]] * (-len(indices) % merge)
    seconds = [i / timing.fps for i in indices]
    stamps = [(seconds[i] + seconds[i + merge - 1]) / 2 for i in range(0, len(seconds), merge)]
    return "".join(f"<{s:.1f} seconds>{start}{pad}{end}" for s in stamps), [0] * len(stamps)


def write_demo(out: Path, variant: str) -> Path:
    from workers.engine.models.qwen3_vl.demo import write_qwen3_vl, write_qwen3_vl_moe

    return write_qwen3_vl_moe(out) if variant == "qwen3_vl_moe" else write_qwen3_vl(out)


FAMILY = ModelFamily(
    name="qwen3_vl",
    parse=parse,
    build=build,
    # Images and video frame groups alike take positions as Qwen2-VL images do: timestamp text, not
    # temporal coordinates, separates a video's groups (video_layout).
    positions=mrope_positions,
    delta=mrope_delta,
    write_demo=write_demo,
    description="Qwen3-VL 2B / 4B / 8B / 32B dense, 30B-A3B / 235B-A22B MoE",
    video_layout=video_layout,
    build_tower=tower_builder(build_vision),
)
