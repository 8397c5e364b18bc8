"""Where config.json omits a field, each family reads the value transformers' own config class gives it (head_dim,
rms_norm_eps), resolves Qwen2.5-VL's tie flag as its config class does, and takes stop ids in
``GenerationConfig.from_model_config``'s order when there is no generation_config.json. Each case starts from a
family's demo config.json with the field taken out, so the checkpoint is otherwise one glimpse serves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workers.engine.models import family
from workers.engine.models.qwen2_5_vl.lm import TextSpec as Qwen25TextSpec
from workers.engine.models.qwen3_5.spec import TextSpec as Qwen35TextSpec
from workers.engine.models.qwen3_vl.lm import TextSpec as Qwen3TextSpec


def _config(model_dir: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    return cfg


def test_qwen3_5_head_dim_defaults_to_transformers_256(qwen3_5_model_dir: Path, qwen3_5_moe_model_dir: Path) -> None:
    """Not hidden_size / num_attention_heads (64 / 4 = 16 here): Qwen3_5TextConfig's default is 256 (so is the MoE
    one's). The M-RoPE sections go too, so transformers' default [11, 11, 10] fits 256 * 0.25 rotary dims."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    for model_dir, cls in ((qwen3_5_model_dir, Qwen3_5Config), (qwen3_5_moe_model_dir, Qwen3_5MoeConfig)):
        cfg = _config(model_dir)
        del cfg["text_config"]["head_dim"], cfg["text_config"]["rope_parameters"]["mrope_section"]
        ours = Qwen35TextSpec.from_hf_config(cfg)
        reference: Any = cls.from_dict(cfg).text_config
        assert ours.head_dim == reference.head_dim == 256
        assert ours.rotary_dim == 64 and ours.mrope_section == (11, 11, 10)


def test_qwen3_vl_head_dim_defaults_per_architecture(qwen3_model_dir: Path, qwen3_moe_model_dir: Path) -> None:
    """Qwen3VLTextConfig defaults head_dim to 128; Qwen3VLMoeTextConfig has no default (hidden / heads = 16)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    dense = _config(qwen3_model_dir)
    del dense["text_config"]["head_dim"], dense["text_config"]["rope_parameters"]["mrope_section"]
    reference: Any = Qwen3VLConfig.from_dict(dense).text_config
    assert Qwen3TextSpec.from_hf_config(dense).head_dim == reference.head_dim == 128
    moe = _config(qwen3_moe_model_dir)
    del moe["text_config"]["head_dim"]
    moe_reference: Any = Qwen3VLMoeConfig.from_dict(moe).text_config
    hidden, heads = moe_reference.hidden_size, moe_reference.num_attention_heads
    assert Qwen3TextSpec.from_hf_config(moe).head_dim == hidden // heads == 16


def test_qwen2_5_vl_rms_norm_eps_and_tie_flag_as_transformers(demo_model_dir: Path) -> None:
    from transformers import Qwen2_5_VLConfig

    cfg = _config(demo_model_dir)
    del cfg["text_config"]["rms_norm_eps"]
    reference: Any = Qwen2_5_VLConfig.from_dict(cfg)
    assert Qwen25TextSpec.from_hf_config(cfg).rms_norm_eps == reference.text_config.rms_norm_eps == 1e-5
    # A root false beside a text_config true (a pre-v5 save): Qwen2_5_VLConfig forwards the true to the root.
    cfg["tie_word_embeddings"], cfg["text_config"]["tie_word_embeddings"] = False, True
    assert Qwen2_5_VLConfig.from_dict(cfg).tie_word_embeddings
    assert Qwen25TextSpec.from_hf_config(cfg).tie_word_embeddings


def test_stop_ids_without_generation_config_take_the_root_first(gemma4_model_dir: Path, tmp_path: Path) -> None:
    """Gemma 4's Hub configs list [1, 106] at the root and 1 in text_config; with no generation_config.json,
    transformers' generate stops on the root's list."""
    from transformers import Gemma4Config, GenerationConfig

    cfg = _config(gemma4_model_dir)
    eos = cfg["text_config"]["eos_token_id"]
    cfg["eos_token_id"] = [eos, eos + 1]
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # and no generation_config.json beside it
    reference = GenerationConfig.from_model_config(Gemma4Config.from_dict(cfg)).eos_token_id
    assert reference == [eos, eos + 1]
    assert list(family("gemma4").parse(cfg, tmp_path).eos_token_ids) == reference
