"""Model families, chosen by ``architectures`` in a checkpoint's config.json.

Adding a family: one package under this folder exporting ``FAMILY`` (see base.py for what it provides)
and one line in ``ARCHITECTURES``. What families share sits beside the packages: decoder.py (the paged decoder and its
weight loading), decoder_layers.py (its attention, MLP and layer), decoder_spec.py (its config fields), qwen_vit.py (the Qwen-style vision tower), demo_writer.py and demo_templates.py (tiny demo
checkpoints).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing torch only when a family is used keeps `glimpse --help` fast
    from workers.engine.models.base import ModelFamily
from workers.engine.models.model_spec import ModelSpec

# config.json `architectures` value -> family package.
ARCHITECTURES: dict[str, str] = {
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
    "Gemma4ForConditionalGeneration": "gemma4",
}
# The families `glimpse demo-model --family` can write (a family may serve several architectures).
DEMO_FAMILIES: dict[str, str] = {
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "gemma4": "gemma4",
    "gemma4_moe": "gemma4",
}


class UnsupportedModel(ValueError):
    """The checkpoint's architecture has no family here (the message names the supported ones)."""


def family(name: str) -> ModelFamily:
    """The family package ``name`` (a value of ARCHITECTURES)."""
    module = importlib.import_module(f"workers.engine.models.{name}")
    fam: ModelFamily = module.FAMILY
    return fam


def family_for(config: dict[str, Any]) -> ModelFamily:
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return family(ARCHITECTURES[arch])
    supported = ", ".join(sorted(ARCHITECTURES))
    found = ", ".join(archs) if archs else "none (no `architectures` in config.json)"
    raise UnsupportedModel(f"unsupported model architecture {found}; glimpse serves: {supported}")


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Read config.json (and generation_config.json) once and parse it with the checkpoint's family."""
    path = Path(model_dir)
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise UnsupportedModel(f"{path} is not a checkpoint directory (no config.json)") from None
    from workers.engine.models.quantization import (  # imports torch
        UnsupportedQuantization,
        parse_quantization,
    )

    fam = family_for(config)
    try:
        parse_quantization(config)  # an unsupported method stops here, before any worker starts
    except UnsupportedQuantization as exc:
        raise UnsupportedModel(str(exc)) from None
    return fam.parse(config, path)


__all__ = ["ARCHITECTURES", "DEMO_FAMILIES", "UnsupportedModel", "family", "family_for", "load_spec"]
