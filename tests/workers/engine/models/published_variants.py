"""Tiny checkpoints in the Hub layout with the config fields where the published sizes differ from the demos: each
family's demo writer with another family member's shape (tied heads of the small sizes, other linear-attention head
ratios and GQA groups, other layer patterns, per-layer inputs, KV sharing and an audio tower, the original flat
config of Qwen2.5-VL). The values are scaled down; what each variant keeps is the relation that sets a code path
apart (a ratio, a flag, where a pattern starts or ends), named in ``published`` with the sizes that have it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

L, F = "linear_attention", "full_attention"
S, G = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Variant:
    demo: str  # the demo family whose writer makes it (workers/engine/models/__init__.py, DEMO_FAMILIES)
    published: str  # the published checkpoints with these fields (their values, scaled down)
    text: Mapping[str, Any] = field(default_factory=dict)
    vision: Mapping[str, Any] = field(default_factory=dict)
    root: Mapping[str, Any] = field(default_factory=dict)  # Gemma 4: config.json's root (the audio tower)
    flat: bool = False  # Qwen2.5-VL: the original top-level config.json and tensor names the Hub repos have
    # TextSpec fields and the values the parsed checkpoint must have (so the variant cannot quietly be the demo).
    expect: Mapping[str, Any] = field(default_factory=dict)


# Gemma 4 E models' audio tower at toy sizes: glimpse drops its tensors, transformers builds and ignores it.
AUDIO = {"model_type": "gemma4_audio", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
         "subsampling_conv_channels": [8, 4], "output_proj_dims": 48}  # fmt: skip
E2B_LAYERS = [S, S, S, S, G] * 2  # 4:1, as E2B's 35 layers
E4B_LAYERS = [S, S, S, S, S, G] * 2  # 5:1, as E4B's 42 layers
# Per-layer inputs and KV sharing as E2B / E4B: no K = V, the global layers' KV heads are num_key_value_heads.
E_MODEL = {"hidden_size_per_layer_input": 8, "attention_k_eq_v": False, "num_global_key_value_heads": None}

VARIANTS: dict[str, Variant] = {
    "qwen3_5-0.8b": Variant(
        "qwen3_5", "Qwen3.5-0.8B / 2B: as many value heads as key heads (16 / 16), tied head, head_dim 256 with "
        "transformers' default M-RoPE sections, 4 query heads per KV head",
        text={"linear_num_key_heads": 2, "linear_num_value_heads": 2, "tie_word_embeddings": True,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                  "mrope_section": [11, 11, 10], "mrope_interleaved": True}},
        vision={"hidden_size": 128, "num_heads": 2, "intermediate_size": 96},  # vision head_dim 64, as 768 / 12
        expect={"linear_num_value_heads": 2, "tie_word_embeddings": True, "rotary_dim": 64},
    ),
    "qwen3_5-27b": Variant(
        "qwen3_5", "Qwen3.5 / 3.6-27B: 3 value heads per key head (48 / 16), 6 query heads per KV head (24 / 4), "
        "[linear x3, full] twice",
        text={"linear_num_key_heads": 2, "linear_num_value_heads": 6, "num_attention_heads": 6,
              "num_key_value_heads": 1, "num_hidden_layers": 8, "layer_types": [L, L, L, F] * 2},
        expect={"linear_num_value_heads": 6, "num_key_value_heads": 1, "layer_types": (L, L, L, F) * 2},
    ),
    "qwen3_5-122b-a10b": Variant(
        "qwen3_5_moe", "Qwen3.5-122B-A10B / 397B-A17B: 4 value heads per key head (64 / 16), 16 query heads per KV "
        "head (32 / 2); the 35B-A3B's [linear x3, full]",
        text={"linear_num_key_heads": 1, "linear_num_value_heads": 4, "num_attention_heads": 4,
              "num_key_value_heads": 1, "num_hidden_layers": 4, "layer_types": [L, L, L, F]},
        expect={"linear_num_value_heads": 4, "num_key_value_heads": 1, "layer_types": (L, L, L, F)},
    ),
    "qwen3_vl-2b": Variant(
        "qwen3_vl", "Qwen3-VL-2B / 4B: tied head, three DeepStack levels",
        text={"tie_word_embeddings": True}, vision={"deepstack_visual_indexes": [1, 2, 3]},
        expect={"tie_word_embeddings": True},
    ),
    "qwen3_vl-235b-a22b": Variant(
        "qwen3_vl_moe", "Qwen3-VL-235B-A22B: 16 query heads per KV head (64 / 4)",
        text={"num_key_value_heads": 1}, expect={"num_key_value_heads": 1},
    ),
    "qwen2_5_vl-3b": Variant(
        "qwen2_5_vl", "Qwen2.5-VL-3B: tied head, 8 query heads per KV head (16 / 2), the original flat config",
        text={"tie_word_embeddings": True, "num_key_value_heads": 1}, flat=True,
        expect={"tie_word_embeddings": True, "num_key_value_heads": 1},
    ),
    "qwen2_5_vl-7b": Variant(
        "qwen2_5_vl", "Qwen2.5-VL-7B / 32B / 72B: the original flat config, untied",
        flat=True, expect={"tie_word_embeddings": False},
    ),
    "gemma4-e2b": Variant(
        "gemma4", "Gemma 4 E2B: 4:1 layers, per-layer inputs, the last layers reading others' KV, double-wide MLPs "
        "there, one KV head, clipped vision linears, an audio tower",
        text={**E_MODEL, "num_hidden_layers": 10, "layer_types": E2B_LAYERS, "num_kv_shared_layers": 4,
              "use_double_wide_mlp": True, "num_key_value_heads": 1},
        vision={"use_clipped_linears": True}, root={"audio_config": AUDIO},
        expect={"kv_sources": (0, 1, 2, 3, 4, 5, 5, 5, 5, 4), "use_double_wide_mlp": True,
                "layer_kv_heads": (1,) * 10, "hidden_size_per_layer_input": 8},
    ),
    "gemma4-e4b": Variant(
        "gemma4", "Gemma 4 E4B: 5:1 layers, per-layer inputs, KV sharing starting right after a global layer, two "
        "KV heads in both layer kinds, an audio tower",
        text={**E_MODEL, "num_hidden_layers": 12, "layer_types": E4B_LAYERS, "num_kv_shared_layers": 6},
        root={"audio_config": AUDIO},
        expect={"kv_sources": (0, 1, 2, 3, 4, 5, 4, 4, 4, 4, 4, 5), "layer_kv_heads": (2,) * 12},
    ),
    "gemma4-26b-a4b": Variant(
        "gemma4_moe", "Gemma 4 26B-A4B: routed experts beside the dense MLP with a tied head",
        text={"tie_word_embeddings": True}, expect={"tie_word_embeddings": True, "num_experts": 4},
    ),
}


def write_variant(variant: Variant, out: Path) -> Path:
    """The variant's checkpoint in ``out`` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    text, vision = dict(variant.text), dict(variant.vision)
    if variant.demo in ("qwen3_5", "qwen3_5_moe"):
        from workers.engine.models.qwen3_5.demo import write_qwen3_5

        return write_qwen3_5(out, moe=variant.demo == "qwen3_5_moe", text=text, vision=vision)
    if variant.demo in ("qwen3_vl", "qwen3_vl_moe"):
        from workers.engine.models.qwen3_vl.demo import write_qwen3_vl, write_qwen3_vl_moe

        return (write_qwen3_vl_moe if variant.demo == "qwen3_vl_moe" else write_qwen3_vl)(out, text, vision)
    if variant.demo in ("gemma4", "gemma4_moe"):
        from workers.engine.models.gemma4.demo import write_gemma4

        return write_gemma4(out, moe=variant.demo == "gemma4_moe", text=text, vision=vision, root=variant.root)
    from workers.engine.models.qwen2_5_vl.demo import write_demo

    write_demo(out, text=text)
    if variant.flat:
        _flatten_qwen2_5_vl(out)
    return out


def _flatten_qwen2_5_vl(out: Path) -> None:
    """Rewrite a transformers 5 save as the Qwen2.5-VL Hub repos have it: text fields at the root with
    ``rope_scaling`` (type "mrope") + ``rope_theta``, ``in_chans`` in vision_config, ``model.layers.*`` /
    ``visual.*`` tensor names."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((out / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    text.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    cfg["vision_config"]["in_chans"] = cfg["vision_config"].pop("in_channels")
    skip = ("model_type", "dtype", "architectures", "tie_word_embeddings")
    (out / "config.json").write_text(json.dumps({**{k: v for k, v in text.items() if k not in skip}, **cfg}))
    weights = out / "model.safetensors"
    renamed = {
        name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1): tensor
        for name, tensor in load_file(weights).items()
    }
    save_file(renamed, weights, metadata={"format": "pt"})
