"""Qwen3.5 / Qwen3.6, dense (``Qwen3_5ForConditionalGeneration``) and MoE (``Qwen3_5MoeForConditionalGeneration``):
a hybrid language model (Gated DeltaNet linear attention in most layers, gated full attention with partial rotary
in the rest, ``layer_types``) behind Qwen3-VL's vision tower without DeepStack.

What the rest of glimpse sees differently from Qwen3-VL: ``ModelSpec.recurrent`` (the linear-attention layers'
per-sequence state; only the full-attention layers keep paged KV, ``ModelSpec.kv_layers``) and the LM's
``allocate_state``. Images and video take Qwen3-VL's processor, prompt layout and M-RoPE positions
(transformers' Qwen3.5 ``get_rope_index`` splits every video into one-frame groups laid out as images, as
``mrope_positions`` does). The checkpoints' multi-token-prediction head (``mtp.*``) is not served: the loader drops
every name outside ``lm.`` / ``visual.``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from workers.engine.models.base import ModelFamily, builder, tower_builder
from workers.engine.models.model_spec import ModelSpec, spec_from
from workers.engine.models.mrope import mrope_delta, mrope_positions
from workers.engine.models.qwen3_5.lm import build_language_model
from workers.engine.models.qwen3_5.spec import TextSpec, recurrent_spec
from workers.engine.models.qwen3_vl import video_layout
from workers.engine.models.qwen3_vl.vision import VisionSpec, build_vision


def vision_spec(cfg: dict[str, Any]) -> VisionSpec:
    """Qwen3-VL's tower fields from ``vision_config``, without DeepStack whatever the config lists (transformers'
    Qwen3.5 tower has no DeepStack mergers; Hub configs carry an empty list)."""
    return replace(VisionSpec.from_hf_config(cfg), deepstack_visual_indexes=())


def parse(cfg: dict[str, Any], model_dir: Path) -> ModelSpec:
    text, vision = TextSpec.from_hf_config(cfg), vision_spec(cfg)
    if vision.out_hidden_size != text.hidden_size:
        raise ValueError(f"vision out_hidden_size {vision.out_hidden_size} != text hidden_size {text.hidden_size}")
    recurrent = recurrent_spec(text) if text.linear_layers else None
    return spec_from("qwen3_5", cfg, model_dir, text, vision, embed_width=vision.out_hidden_size, recurrent=recurrent)


build = builder(build_language_model, build_vision)


def write_demo(out: Path, variant: str) -> Path:
    from workers.engine.models.qwen3_5.demo import write_qwen3_5

    return write_qwen3_5(out, moe=variant == "qwen3_5_moe")


FAMILY = ModelFamily(
    name="qwen3_5",
    parse=parse,
    build=build,
    positions=mrope_positions,
    delta=mrope_delta,
    write_demo=write_demo,
    description="Qwen3.5 / Qwen3.6 dense and MoE (hybrid Gated DeltaNet + gated attention)",
    video_layout=video_layout,
    build_tower=tower_builder(build_vision),
)
