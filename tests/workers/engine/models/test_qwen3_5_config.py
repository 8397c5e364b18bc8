"""Qwen3.5's config parsing: the layer pattern (explicit ``layer_types``, or transformers' default from
``full_attention_interval``), the partial rotary and its M-RoPE sections, the linear-attention and MoE fields, both
config layouts (``text_config``, top level), the ModelSpec the runner sizes its caches from, and the configs and TP
sizes it refuses, each with a message naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.engine.layers.linear import TPGroup
from workers.engine.models import ARCHITECTURES, DEMO_FAMILIES, family_for, load_spec
from workers.engine.models.qwen3_5 import vision_spec
from workers.engine.models.qwen3_5.lm import Qwen3_5LanguageModel
from workers.engine.models.qwen3_5.spec import FULL, LINEAR, TextSpec, check_tp

L, F = LINEAR, FULL
TEXT: dict[str, Any] = {
    "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
}
MOE: dict[str, Any] = {
    **{k: v for k, v in TEXT.items() if k != "intermediate_size"},
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 96,
}


def parse(**overrides: Any) -> TextSpec:
    return TextSpec.from_hf_config({"text_config": {**TEXT, **overrides}})


def test_layer_types_default_from_the_interval() -> None:
    assert parse().layer_types == (L, L, L, F) * 2  # transformers' default interval: 4
    three = parse(full_attention_interval=3, num_hidden_layers=7).layer_types
    assert three == (L, L, F, L, L, F, L)
    assert parse(full_attention_interval=1).layer_types == (F,) * 8
    explicit = (F, L, L, F, L, L, L, L)
    spec = parse(layer_types=list(explicit), full_attention_interval=2)  # an explicit list wins
    assert spec.layer_types == explicit and spec.full_layers == [0, 3] and spec.linear_layers == [1, 2, 4, 5, 6, 7]
    # transformers' own default, from its config class.
    from transformers import Qwen3_5TextConfig

    kwargs: dict[str, Any] = {"num_hidden_layers": 7, "full_attention_interval": 3}  # a kwarg its dataclass pops
    ref: Any = Qwen3_5TextConfig(**kwargs)
    assert parse(**kwargs).layer_types == tuple(ref.layer_types)


def test_fields_and_both_layouts() -> None:
    spec = parse()
    assert (spec.head_dim, spec.rotary_dim, spec.mrope_section, spec.rope_theta) == (32, 8, (2, 1, 1), 1e7)
    assert (spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_conv_kernel_dim) == (2, 4, 4)
    assert spec.num_experts == 0 and not spec.tie_word_embeddings
    # Older exports: text fields at the top level, rope_scaling + rope_theta + partial_rotary_factor beside it.
    rope = dict(TEXT["rope_parameters"])
    top = {**{k: v for k, v in TEXT.items() if k != "rope_parameters"}, "rope_theta": rope.pop("rope_theta"),
           "partial_rotary_factor": rope.pop("partial_rotary_factor"), "rope_scaling": rope}
    assert TextSpec.from_hf_config(top) == spec
    # transformers' defaults: partial_rotary_factor 0.25, mrope_section [11, 11, 10] (of head_dim 256), theta 1e4.
    bare = {k: v for k, v in TEXT.items() if k not in ("rope_parameters", "head_dim")}
    default = TextSpec.from_hf_config({"text_config": {**bare, "head_dim": 256}})
    assert (default.rotary_dim, default.mrope_section, default.rope_theta) == (64, (11, 11, 10), 10000.0)
    # The root's tie flag decides, as transformers 5 reads it.
    assert TextSpec.from_hf_config({"text_config": TEXT, "tie_word_embeddings": True}).tie_word_embeddings
    moe = TextSpec.from_hf_config({"text_config": MOE})
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 48)
    assert moe.shared_expert_intermediate_size == 96


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"layer_types": [L] * 7}, ValueError, "layer_types has 7 entries"),
        ({"layer_types": [L] * 8}, ValueError, "no 'full_attention' layer"),
        ({"layer_types": [F, "sliding_attention"] * 4}, NotImplementedError, "sliding_attention"),
        ({"full_attention_interval": 0}, ValueError, "full_attention_interval"),
        ({"linear_num_value_heads": 3}, ValueError, "multiple of linear_num_key_heads"),
        ({"hidden_act": "gelu"}, NotImplementedError, "hidden_act"),
        ({"attention_bias": True}, NotImplementedError, "attention_bias"),
        ({"attn_output_gate": False}, NotImplementedError, "attn_output_gate"),
        ({"rope_parameters": {**TEXT["rope_parameters"], "rope_type": "yarn"}}, NotImplementedError, "yarn"),
        ({"rope_parameters": {**TEXT["rope_parameters"], "mrope_interleaved": False}}, NotImplementedError,
         "mrope_interleaved"),
        ({"rope_parameters": {**TEXT["rope_parameters"], "mrope_section": [2, 2, 2]}}, ValueError, "rotary_dim/2 = 4"),
        ({"rope_parameters": {**TEXT["rope_parameters"], "partial_rotary_factor": 0.03}}, ValueError,
         "partial_rotary_factor"),
    ],
)
def test_bad_configs_are_refused(overrides: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        parse(**overrides)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ],
)
def test_bad_moe_configs_are_refused(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, NotImplementedError), match=match):
        TextSpec.from_hf_config({"text_config": {**MOE, **overrides}})


def test_tensor_parallel_sizes_that_do_not_divide_are_refused() -> None:
    spec = parse()
    check_tp(spec, 2)  # every head count and width splits in two
    # 4 ranks: 2 KV heads are replicated (each on 2 ranks), but 2 key heads of Gated DeltaNet cannot be.
    with pytest.raises(ValueError, match=r"size 4: linear_num_key_heads=2$"):
        check_tp(spec, 4)
    with pytest.raises(ValueError, match=r"num_attention_heads=4, .*linear_num_value_heads=4, num_key_value_heads=2"):
        check_tp(spec, 3)
    moe = TextSpec.from_hf_config({"text_config": {**MOE, "moe_intermediate_size": 50}})
    with pytest.raises(ValueError, match="moe_intermediate_size=50"):
        check_tp(moe, 4)
    # The model refuses at build time, before allocating anything.
    with pytest.raises(ValueError, match="tensor-parallel size 4"):
        Qwen3_5LanguageModel.build(spec, tp=TPGroup(rank=0, size=4), dtype=torch.float32, device="meta")


def test_model_spec_of_the_demo_checkpoints(qwen3_5_model_dir: Path, qwen3_5_moe_model_dir: Path) -> None:
    assert ARCHITECTURES["Qwen3_5ForConditionalGeneration"] == ARCHITECTURES["Qwen3_5MoeForConditionalGeneration"]
    assert DEMO_FAMILIES["qwen3_5"] == DEMO_FAMILIES["qwen3_5_moe"] == "qwen3_5"
    for model_dir, layers in ((qwen3_5_model_dir, (L, L, L, F)), (qwen3_5_moe_model_dir, (L, F, L))):
        cfg = json.loads((model_dir / "config.json").read_text())
        assert family_for(cfg).name == "qwen3_5"
        spec = load_spec(model_dir)
        assert spec.text.layer_types == layers and spec.num_layers == len(layers)
        assert spec.recurrent is not None and spec.recurrent.num_layers == layers.count(L)
        assert spec.kv_layers == layers.count(F)
        # The full-attention layers' shape is what the KV cache is sized by.
        assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 32)
        assert spec.kv_bytes_per_block(16, torch.float32) == 2 * spec.kv_layers * 16 * 2 * 32 * 4
        assert spec.recurrent.conv_shape(2) == (64, 3) and spec.recurrent.ssm_shape(2) == (2, 16, 16)
        assert spec.embed_width == spec.hidden_size == 64  # no DeepStack columns
        assert spec.image_token_id == cfg["image_token_id"] and spec.eos_token_ids
    # Qwen3-VL's tower fields, DeepStack dropped even where a config lists levels.
    assert vision_spec({"vision_config": {"depth": 4, "deepstack_visual_indexes": [1]}}).deepstack_visual_indexes == ()
