"""Loading Qwen3-VL-MoE's experts: the layout transformers saves, missing or malformed expert tensors named, and the
runner's streaming load (partial calls, then one completeness check). The forward over every layout, against
transformers: test_qwen3_lm.py; the expert kernels: test_qwen3_moe_kernels.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.workers.engine.models.qwen3_tiny import expert_variant
from workers.engine.models.loader import normalize_name
from workers.engine.models.qwen3_vl.lm import TextSpec, build_language_model


def test_transformers_saves_experts_in_its_in_memory_layout(qwen3_tiny: dict[str, tuple[Path, Any]]) -> None:
    """What save_pretrained writes (transformers 5.24): [E, 2I, H] / [E, H, I], not the Hub's transpose."""
    tensors = load_file(qwen3_tiny["moe"][0] / "model.safetensors")
    assert tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 96, 64)
    assert tensors["model.language_model.layers.0.mlp.experts.down_proj"].shape == (8, 64, 48)


def test_missing_or_malformed_expert_weights_are_named(
    qwen3_tiny: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    path = expert_variant(qwen3_tiny["moe"][0], tmp_path / "split", "moe_per_expert")
    tensors = load_file(path / "model.safetensors")
    victim = "model.language_model.layers.2.mlp.experts.5.up_proj.weight"
    del tensors[victim]
    spec = TextSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    model = build_language_model(spec, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts\.gate_up_proj"):
        model.load_weights((normalize_name(n), t) for n, t in tensors.items())
    bad = torch.zeros(8, 64, 64)  # fits neither [E, 2I, H] nor [E, H, 2I]
    with pytest.raises(ValueError, match="neither"):
        model.load_weights([("lm.layers.0.mlp.experts.gate_up_proj", bad)], partial=True)


def test_partial_loads_then_check(qwen3_tiny: dict[str, tuple[Path, Any]]) -> None:
    """The shape of the runner's streaming load: several partial calls, then one completeness check."""
    path, _ = qwen3_tiny["moe"]
    spec = TextSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    model = build_language_model(spec, dtype=torch.float32, device="cpu")
    items = [(normalize_name(n), t) for n, t in load_file(path / "model.safetensors").items()]
    model.load_weights(items[::2], partial=True)
    with pytest.raises(ValueError, match="lacks"):
        model.check_loaded()
    model.load_weights(items[1::2], partial=True)
    model.check_loaded()
