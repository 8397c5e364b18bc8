"""Tiny, random-weight Qwen3.5 (dense) and Qwen3.5-MoE checkpoints, written on the spot like the other demos
(workers/engine/models/demo_writer.py: the same tokenizer, seeds and per-name weight init) in the layout the Hub
checkpoints have: config.json with ``text_config`` / ``vision_config`` as transformers 5 saves ``Qwen3_5Config``,
``model.language_model.*`` / ``model.visual.*`` / ``lm_head.weight`` tensors, one tensor per routed expert (as
transformers 5 saves them), and a multi-token-prediction head (``mtp.*``) that serving skips.

The vision side, processor settings and chat template are the Qwen3-VL demo's (qwen3_vl/demo.py): Qwen3.5 uses
Qwen3-VL's processor, image and video processors, and tower (without DeepStack).

Layer patterns: dense 4 layers, linear x3 then full (transformers' default every-4th-layer rule); MoE 3 layers,
linear / full / linear, so neither the first nor the last layer's kind is the same in both demos.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workers.engine.models.demo_writer import (
    LINEAR_STD,
    init_model,
    padded_vocab,
    save_model,
)
from workers.engine.models.qwen3_vl.demo import (
    MERGE,
    MERGER_OUT_GAIN,
    PATCH,
    POS_EMBED_GAIN,
    QK_NORM_GAIN,
    TEMPORAL,
    write_processor,
)

LINEAR, FULL = "linear_attention", "full_attention"
DENSE_LAYERS = (LINEAR, LINEAR, LINEAR, FULL)
MOE_LAYERS = (LINEAR, FULL, LINEAR)
# The per-name init draws every decay rate A = exp(A_log) near 1, so the recurrent state would forget ~half of itself
# per token and a state lost between chunks would hardly show. Centred on A = 0.05 instead (g ~ -0.05 per token),
# a token still weighs ~e^-1 twenty tokens later: chunks, snapshots and forks really depend on the carried state.
DECAY_A = 0.05
# Zero-centred norms (the decoder's RMSNorms, x * (1 + w)) get w = scale - 1, so their effective scale has the
# shared init's spread around 1 (q/k norms: QK_NORM_GAIN times it, as in the Qwen3-VL demo).
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")
# Stands in for the Hub checkpoints' multi-token-prediction head: glimpse and transformers must both skip it.
MTP_TENSORS = {"mtp.fc.weight": (64, 128), "mtp.norm.weight": (64,), "mtp.layers.0.mlp.gate.weight": (8, 64)}


def _vision_config() -> dict[str, Any]:
    return {
        "depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "out_hidden_size": 64,
        "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL,
        "num_position_embeddings": 64,  # an 8x8 table, bilinearly resized to every other grid
        "deepstack_visual_indexes": [],  # as the Hub configs say: Qwen3.5's tower has no DeepStack
        "initializer_range": LINEAR_STD,
    }


def _text_config(moe: bool, ids: dict[str, int], vocab_size: int) -> dict[str, Any]:
    text: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "hidden_act": "silu",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        # Rotary on a quarter of each head (8 of 32 dims, as the real models' 64 of 256): 4 frequencies,
        # interleaved t/h/w/t.
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True,
        },
        # Gated DeltaNet: 2 key heads each read by 2 value heads, so the grouping (value head j -> key head j // 2)
        # is exercised; all head counts split over 2 TP ranks.
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "attention_bias": False,
        "tie_word_embeddings": False,  # untied, so a loader that ties (or drops lm_head) changes the output
        "initializer_range": LINEAR_STD,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
    }
    if moe:
        # moe_intermediate_size 48: 2 * 48 != hidden 64, so a fused expert tensor's layout shows in its shape.
        text.update(num_hidden_layers=len(MOE_LAYERS), layer_types=list(MOE_LAYERS), num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96)
    else:
        text.update(num_hidden_layers=len(DENSE_LAYERS), layer_types=list(DENSE_LAYERS), intermediate_size=128)
    return text


def _config(
    moe: bool, ids: dict[str, int], vocab_size: int, text: Mapping[str, Any], vision: Mapping[str, Any]
) -> Any:
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
    text_config = {**_text_config(moe, ids, vocab_size), **text}
    return cls(
        text_config=text_config,
        vision_config={**_vision_config(), **vision},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        # transformers ties only on the root's flag; the Hub configs of the tied sizes carry it in both places.
        tie_word_embeddings=text_config["tie_word_embeddings"],
        dtype="float32",
    )


def _apply_gains(model: Any) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                param.copy_(QK_NORM_GAIN * param - 1.0)
            elif name.endswith(ZERO_CENTRED) or name == "model.language_model.norm.weight":
                param.sub_(1.0)
            elif name.endswith(".A_log"):
                param.add_(math.log(DECAY_A))
            elif name.endswith("visual.pos_embed.weight"):
                param.mul_(POS_EMBED_GAIN)
            elif "merger" in name and ".linear_fc2." in name:
                param.mul_(MERGER_OUT_GAIN)


def _add_mtp_head(file: Path) -> None:
    """Add the MTP head's stand-in tensors to the saved checkpoint (transformers' model has no MTP module; it already
    writes routed experts one tensor per expert and projection, as the Hub does)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    gen = torch.Generator().manual_seed(5)
    for name, shape in MTP_TENSORS.items():
        tensors[name] = torch.randn(shape, generator=gen)
    save_file(tensors, file, metadata={"format": "pt"})


def write_qwen3_5(
    out: Path, moe: bool, text: Mapping[str, Any] | None = None, vision: Mapping[str, Any] | None = None
) -> Path:
    """Write the Qwen3.5 (``moe``: Qwen3.5-MoE) demo checkpoint into ``out`` (created if missing). Same bytes on every
    run. ``text`` / ``vision``: fields replacing the demo's in ``text_config`` / ``vision_config`` (the shapes of
    other published sizes, for tests); a tied ``text`` ties the root too, and the head is then not saved."""
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    ids, n_tokens = write_processor(out)
    model_cls = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    model = init_model(model_cls, _config(moe, ids, padded_vocab(n_tokens), text or {}, vision or {}))
    _apply_gains(model)
    save_model(model, ids, n_tokens, out)
    _add_mtp_head(out / "model.safetensors")
    return out
