"""Tiny random Qwen3-VL checkpoints, dense and MoE, saved by transformers (CPU, float32) for the LM tests, and the
other ways real checkpoints store MoE experts (the Hub's fused layout, one tensor per expert)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from workers.engine.layers.linear import SINGLE_RANK, TPGroup
from workers.engine.models.loader import normalize_name
from workers.engine.models.qwen3_vl.lm import Qwen3VLLanguageModel, TextSpec, build_language_model

HIDDEN = 64
TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
        "rope_theta": 10000.0,
    },
}
# 2I = 96 != H = 64, so the Hub's [E, H, 2I] and transformers' [E, 2I, H] expert layouts can be told apart.
MOE_TEXT_CONFIG: dict[str, Any] = {
    **TEXT_CONFIG,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],  # layers 0 and 2 sparse, layer 1 dense
}
VISION_CONFIG: dict[str, Any] = dict(
    depth=1,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=HIDDEN,
    deepstack_visual_indexes=[0],
)
FORMATS = ["dense", "moe_saved", "moe_hub", "moe_per_expert"]

def randomize(hf: Any) -> None:
    # Default init leaves norms at 1; draw every weight so loading each one is actually checked.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.05
            p.copy_(1.0 + 2 * noise if "norm" in name else noise)


def save_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """kind ("dense", "moe") -> (directory written by transformers' save_pretrained, the model itself)."""
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    out = {}
    for kind in ("dense", "moe"):
        torch.manual_seed(0)
        hf: Any
        if kind == "dense":
            hf = Qwen3VLForConditionalGeneration(
                Qwen3VLConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG)
            )
        else:
            cfg = Qwen3VLMoeConfig(text_config=MOE_TEXT_CONFIG, vision_config=VISION_CONFIG)
            hf = Qwen3VLMoeForConditionalGeneration(cfg)
        hf = hf.float().eval()
        randomize(hf)
        path = tmp_path_factory.mktemp(f"tiny_qwen3_vl_{kind}")
        hf.save_pretrained(path)
        out[kind] = (path, hf)
    return out


def expert_variant(src: Path, dst: Path, fmt: str) -> Path:
    """Rewrite the saved MoE checkpoint's experts as the Hub stores them, or split per expert."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[name] = t
        elif fmt == "moe_hub":  # x @ W layout: gate_up [E, H, 2I], down [E, I, H]
            out[name] = t.transpose(1, 2).contiguous()
        elif name.endswith("gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                out[f"{base}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{base}{e}.up_proj.weight"] = up.contiguous()
        else:
            base = name[: -len("down_proj")]
            for e, w in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = w.contiguous()
    save_file(out, dst / "model.safetensors")
    return dst


def checkpoint_dir(saved: dict[str, tuple[Path, Any]], fmt: str, tmp: Path) -> tuple[Path, Any]:
    """The checkpoint of ``fmt`` (one of FORMATS) and the transformers model it holds."""
    if fmt == "dense":
        return saved["dense"]
    path, hf = saved["moe"]
    return (path, hf) if fmt == "moe_saved" else (expert_variant(path, tmp / fmt, fmt), hf)


def load_ours(path: Path, tp: TPGroup = SINGLE_RANK) -> Qwen3VLLanguageModel:
    """Our LM built from the checkpoint's config and loaded from all its shards (this rank's slices)."""
    spec = TextSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    model = build_language_model(spec, tp=tp, dtype=torch.float32, device="cpu", attn_backend="sdpa")
    tensors: dict[str, Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    model.load_weights((normalize_name(n), t) for n, t in tensors.items())
    return model
