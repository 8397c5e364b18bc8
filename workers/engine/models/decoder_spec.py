"""A decoder's shape and numerics as a Qwen-style config.json gives them: the fields every family's TextSpec starts
from (``DecoderSpec``) and the reader of the ones the Qwen families spell alike (``decoder_fields``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderSpec:
    """Shape and numerics of a decoder, read from a checkpoint's config.json (``decoder_fields`` plus the tie flag,
    which each family reads its own way); a family's TextSpec adds its own fields."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    tie_word_embeddings: bool
    max_position_embeddings: int


def decoder_fields(
    cfg: dict[str, Any],
    *,
    default_theta: float,
    default_section: tuple[int, ...],
    default_max_len: int,
    default_head_dim: int | None = None,
    default_eps: float = 1e-6,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The decoder fields a Qwen-style config.json spells alike, as (TextSpec fields, the LM's config section,
    its RoPE section). LM fields sit in ``text_config`` (transformers 5) or at the top level; RoPE in
    ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (older, type spelled "mrope").

    ``default_head_dim`` / ``default_eps``: the family's transformers config defaults where config.json omits the
    field (None: hidden_size / num_attention_heads, as transformers derives it for configs without a default)."""
    text = {**cfg, **(cfg.get("text_config") or {})}
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or default_head_dim or int(text["hidden_size"]) // heads)
    rope: dict[str, Any] = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise NotImplementedError(f"rope type {rope_type!r} is not supported (only plain M-RoPE)")
    section = tuple(int(s) for s in rope.get("mrope_section", default_section))
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {section} must be 3 sizes summing to head_dim/2 = {head_dim // 2}")
    if text.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {text['hidden_act']!r} is not supported")
    if text.get("use_sliding_window"):
        raise NotImplementedError("sliding-window attention layers are not supported")
    fields = {
        "hidden_size": int(text["hidden_size"]),
        "num_hidden_layers": int(text["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(text.get("num_key_value_heads") or heads),
        "head_dim": head_dim,
        "intermediate_size": int(text["intermediate_size"]),
        "vocab_size": int(text["vocab_size"]),
        "rms_norm_eps": float(text.get("rms_norm_eps", default_eps)),
        "rope_theta": float(rope.get("rope_theta", text.get("rope_theta", default_theta))),
        "mrope_section": section,
        "max_position_embeddings": int(text.get("max_position_embeddings", default_max_len)),
    }
    return fields, text, rope
