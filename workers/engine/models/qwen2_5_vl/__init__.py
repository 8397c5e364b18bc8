"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): windowed-attention ViT with 14 px patches, plain
M-RoPE, Qwen2 decoder with q/k/v bias."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from workers.engine.layers import TPGroup
from workers.engine.models.base import ModelFamily, ModelSpec, VLModel, common_fields
from workers.engine.models.qwen2_5_vl.lm import TextSpec, build_language_model
from workers.engine.models.qwen2_5_vl.vision import VisionSpec, build_vision
from workers.engine.mrope import mrope_delta, mrope_positions


def parse(cfg: dict[str, Any], model_dir: Path) -> ModelSpec:
    text, vision = TextSpec.from_hf_config(cfg), VisionSpec.from_hf_config(cfg)
    return ModelSpec(
        family="qwen2_5_vl",
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers,
        num_kv_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        spatial_merge_size=vision.spatial_merge_size,
        patch_dim=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
        embed_width=vision.out_hidden_size,
        max_position_embeddings=text.max_position_embeddings,
        text=text,
        vision=vision,
        **common_fields(cfg, model_dir),
    )


def build(spec: ModelSpec, tp: TPGroup, dtype: torch.dtype, device: torch.device, attn_backend: str) -> VLModel:
    lm = build_language_model(spec.text, tp=tp, dtype=dtype, device=device, attn_backend=attn_backend)
    backend: Any = attn_backend
    vision = build_vision(spec.vision, dtype=dtype, device=device, attn_backend=backend)
    return VLModel(spec, lm, vision)


def write_demo(out: Path, variant: str) -> Path:
    from workers.engine.models.qwen2_5_vl.demo import write_demo as write

    return write(out, variant)


FAMILY = ModelFamily(
    name="qwen2_5_vl",
    parse=parse,
    build=build,
    positions=mrope_positions,
    delta=mrope_delta,
    write_demo=write_demo,
    description="Qwen2.5-VL 3B / 7B / 32B / 72B",
)
