"""Gemma 4 (``Gemma4ForConditionalGeneration``: 31B dense, 26B-A4B MoE, E2B / E4B): the first family that shares no
module with Qwen.

- Vision (vision.py, vision_layers.py): a SigLIP-style ViT with learned 2-D position tables and axial rotary,
  3 x 3 average pooling by patch position, then the multimodal embedder into the LM's width. An image's token count
  is its pooled grid, set by a token budget per image (70 / 140 / 280 / 560 / 1120; processing.py).
- Language model (spec.py, lm.py, lm_layers.py, moe.py): sliding-window layers interleaved with global layers of
  another head dim and a proportional partial rotary; KV shared across the last layers; ``attention_k_eq_v``;
  per-layer inputs (E models); routed experts beside the dense MLP (26B-A4B); soft-capped logits. Positions are
  1-D (linear_positions.py).
- Image tokens attend to each other both ways on the sliding layers (``ModelSpec.bidirectional_images``): the
  scheduler never ends a prefill chunk inside an image's span, so every chunk sees each image it computes whole.

The E models' audio tower is not served: its tensors are dropped at load and audio parts get a 400.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from workers.engine.models.base import ModelFamily, builder, tower_builder
from workers.engine.models.gemma4.lm import Gemma4LanguageModel
from workers.engine.models.gemma4.processing import Gemma4Images, frame_layout_of
from workers.engine.models.gemma4.spec import TextSpec
from workers.engine.models.gemma4.vision import VisionSpec, build_vision
from workers.engine.models.linear_positions import linear_delta, linear_positions
from workers.engine.models.model_spec import ModelSpec, spec_from


def parse(cfg: dict[str, Any], model_dir: Path) -> ModelSpec:
    text, vision = TextSpec.from_hf_config(cfg), VisionSpec.from_hf_config(cfg)
    spec = spec_from("gemma4", cfg, model_dir, text, vision, embed_width=text.hidden_size)
    return replace(
        spec,
        image_token_id=int(cfg.get("image_token_id", 258_880)),
        video_token_id=int(cfg.get("video_token_id", 258_884)),
        vision_start_token_id=int(cfg.get("boi_token_id", 255_999)),
        kv_shapes=text.kv_shapes(),
        kv_windows=tuple(text.window(layer) for layer in text.kv_owner_layers),
        bidirectional_images=text.bidirectional_vision,
    )


build = builder(Gemma4LanguageModel.build, build_vision)


def write_demo(out: Path, variant: str) -> Path:
    from workers.engine.models.gemma4.demo import write_gemma4

    return write_gemma4(out, moe=variant == "gemma4_moe")


FAMILY = ModelFamily(
    name="gemma4",
    parse=parse,
    build=build,
    positions=linear_positions,
    delta=linear_delta,
    write_demo=write_demo,
    description="Gemma 4 dense and MoE (sliding-window + global attention, per-image token budgets)",
    images=Gemma4Images,
    frame_layout=frame_layout_of,
    build_tower=tower_builder(build_vision),
)
