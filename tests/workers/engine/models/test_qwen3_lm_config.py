"""Qwen3-VL's TextSpec: every config.json layout (transformers 5's text_config, the original top-level fields), the
MoE fields and sparse-layer rule, and the settings it refuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.workers.engine.models.qwen3_tiny import MOE_TEXT_CONFIG, TEXT_CONFIG
from workers.engine.models.qwen3_vl.lm import TextSpec


def test_text_spec_reads_every_layout(qwen3_tiny: dict[str, tuple[Path, Any]]) -> None:
    dense = TextSpec.from_hf_config(json.loads((qwen3_tiny["dense"][0] / "config.json").read_text()))
    assert dense.mrope_section == (2, 3, 3) and dense.mrope_interleaved and dense.num_experts == 0
    assert dense.head_dim == 16 and dense.rope_theta == 10000.0 and not dense.tie_word_embeddings
    # Original layout: text fields at top level, rope_scaling + rope_theta.
    text = {k: v for k, v in TEXT_CONFIG.items() if k != "rope_parameters"}
    rope = dict(TEXT_CONFIG["rope_parameters"])
    old = {**text, "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    assert TextSpec.from_hf_config(old) == TextSpec.from_hf_config({"text_config": TEXT_CONFIG})
    assert dense == TextSpec.from_hf_config({"text_config": TEXT_CONFIG, "tie_word_embeddings": False})

    moe_cfg = json.loads((qwen3_tiny["moe"][0] / "config.json").read_text())
    assert (
        moe_cfg["text_config"]["num_local_experts"] == 8
    )  # transformers 5 writes num_experts under this name
    # ... and a text_config tie flag of true that the root (false) overrides: the root decides, as there.
    assert moe_cfg["text_config"]["tie_word_embeddings"] and not moe_cfg["tie_word_embeddings"]
    moe = TextSpec.from_hf_config(moe_cfg)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 48)
    assert not moe.tie_word_embeddings
    assert [moe.layer_is_sparse(i) for i in range(3)] == [True, False, True]
    step2 = TextSpec.from_hf_config(
        {"text_config": {**MOE_TEXT_CONFIG, "decoder_sparse_step": 2, "mlp_only_layers": []}}
    )
    assert [step2.layer_is_sparse(i) for i in range(3)] == [False, True, False]
    assert TextSpec.from_hf_config(
        {"text_config": TEXT_CONFIG, "tie_word_embeddings": True}
    ).tie_word_embeddings
    assert TextSpec.from_hf_config(
        {"text_config": {**TEXT_CONFIG, "tie_word_embeddings": True}}
    ).tie_word_embeddings

    bad_configs: list[dict[str, Any]] = [
        {"rope_parameters": {**rope, "rope_type": "yarn", "rope_theta": 1.0}},
        {"hidden_act": "gelu"},
        {"use_sliding_window": True},
    ]
    for bad in bad_configs:
        with pytest.raises(NotImplementedError):
            TextSpec.from_hf_config({"text_config": {**TEXT_CONFIG, **bad}})
    with pytest.raises(NotImplementedError, match="norm_topk_prob"):
        TextSpec.from_hf_config({"text_config": {**MOE_TEXT_CONFIG, "norm_topk_prob": False}})
    with pytest.raises(ValueError, match="mrope_section"):
        TextSpec.from_hf_config(
            {
                "text_config": {
                    **TEXT_CONFIG,
                    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 2, 2]},
                }
            }
        )
