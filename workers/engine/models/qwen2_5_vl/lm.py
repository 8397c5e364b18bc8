"""glimpse's own Qwen2.5-VL language model (decoder only; the vision tower lives in vision.py).

Numerically it follows transformers' ``Qwen2_5_VLTextModel``: RMSNorm, GQA attention with q/k/v bias (o_proj
without), SwiGLU MLP and multimodal RoPE (M-RoPE) in contiguous sections. Structurally it is the serving decoder
of models/decoder.py: a flattened token batch, a paged KV cache per layer behind an attention backend, and
tensor-parallel layers whose weight loaders slice the full Hugging Face tensors per rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from workers.engine.layers.linear import SINGLE_RANK, TPGroup
from workers.engine.layers.rotary import MRopeAngles, apply_rope, mrope_rows
from workers.engine.models.decoder import PagedDecoder
from workers.engine.models.decoder_layers import DecoderAttention, DecoderLayer, SwiGLUMLP
from workers.engine.models.decoder_spec import DecoderSpec, decoder_fields
from workers.engine.models.loader import fill_dummy_weights, iter_safetensors, normalize_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextSpec(DecoderSpec):
    """Shape and numerics of the language model, read from a checkpoint's config.json."""

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> TextSpec:
        """Parse either layout: LM fields at top level (original Qwen) or in ``text_config`` (transformers 5).

        RoPE settings come from ``rope_parameters`` (transformers 5) or ``rope_scaling`` +
        ``rope_theta`` (older configs, where the type is spelled ``"mrope"``).
        """
        # Qwen2_5_VLTextConfig's rms_norm_eps default is 1e-5 (not the 1e-6 every published config states).
        fields, _, _ = decoder_fields(
            cfg, default_theta=1_000_000.0, default_section=(16, 24, 24), default_max_len=32768, default_eps=1e-5
        )
        nested: dict[str, Any] = cfg.get("text_config") or {}
        # transformers 5 keeps the flag at the root; pre-v5 saves put it in text_config. Either wins (as
        # Qwen2_5_VLConfig forwards a text_config true over a root false).
        tie = bool(cfg.get("tie_word_embeddings")) or bool(nested.get("tie_word_embeddings"))
        return TextSpec(tie_word_embeddings=tie, **fields)


class MRotaryEmbedding(MRopeAngles):
    """positions [3, T] -> cos [T, 1, D] and sign-folded sin [T, 1, D] in ``dtype``, for every layer of a forward.

    As transformers' Qwen2.5-VL does: the float32 angles duplicated over both halves of head_dim (the
    rotate_half layout), then cos and sin of the whole row, then the cast."""

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = self.angles(positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        return rope_tables(emb.cos().to(dtype), emb.sin().to(dtype))


def rope_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """[T, D] cos, sin -> [T, 1, D] cos and sign-folded sin for ``apply_rope`` (once per forward).

    ``rotate_half(x) * sin`` equals ``swap_halves(x) * cat(-sin_lo, sin_hi)`` bit for bit (negation is
    exact and rounding is symmetric), so the negation moves out of the 28 layers into this one call.
    """
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.unsqueeze(1), signed.unsqueeze(1)


class Qwen2_5_VLLanguageModel(PagedDecoder):
    """The decoder stack over a flattened batch of new tokens with a paged KV cache. Qwen2.5-VL has no DeepStack:
    its image entries are the main embeddings alone."""

    def __init__(self, spec: TextSpec, tp: TPGroup = SINGLE_RANK, attn_backend: str = "auto") -> None:
        super().__init__(spec, tp, attn_backend)
        self.layers = nn.ModuleList(
            DecoderLayer(
                DecoderAttention(spec, tp, qkv_bias=True, o_bias=False),
                SwiGLUMLP(spec.hidden_size, spec.intermediate_size, tp),
                spec.hidden_size,
                spec.rms_norm_eps,
            )
            for _ in range(spec.num_hidden_layers)
        )
        self.add_head()
        self.rotary = MRotaryEmbedding(spec.head_dim, spec.rope_theta, mrope_rows(spec.mrope_section, False))


build_language_model = Qwen2_5_VLLanguageModel.build


def load_language_model(
    model_dir: str | Path,
    spec: TextSpec,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPGroup = SINGLE_RANK,
    load_format: Literal["auto", "dummy"] = "auto",
    attn_backend: str = "auto",
    seed: int = 0,
) -> Qwen2_5_VLLanguageModel:
    """The LM alone, filled from the checkpoint (this rank's shards only) or, with ``load_format="dummy"``,
    with deterministic random weights. For tests and benchmarks of the LM by itself; serving goes through
    the family's ``build`` and ``load_model``."""
    model = build_language_model(spec, tp=tp, dtype=dtype, device=device, attn_backend=attn_backend)
    if load_format == "dummy":
        fill_dummy_weights(model, seed=seed + tp.rank)
    elif load_format == "auto":
        weights = iter_safetensors(model_dir, name_filter=lambda n: normalize_name(n).startswith("lm."))
        model.load_weights((normalize_name(n), t) for n, t in weights)
    else:
        raise ValueError(f"unknown load_format {load_format!r}")
    return model


# apply_rope: the kernel tests and benchmarks take this family's rotary reference from here.
__all__ = [
    "MRotaryEmbedding",
    "Qwen2_5_VLLanguageModel",
    "TextSpec",
    "apply_rope",
    "build_language_model",
    "load_language_model",
    "rope_tables",
]
