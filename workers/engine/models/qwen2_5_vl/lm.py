"""glimpse's own Qwen2.5-VL language model (decoder only; the vision tower lives in vision.py).

Numerically it follows transformers' ``Qwen2_5_VLTextModel``: RMSNorm, GQA attention with q/k/v
bias (o_proj without), SwiGLU MLP and multimodal RoPE (M-RoPE). Structurally it is built for
serving: a flattened token batch, a paged KV cache per layer behind an attention backend, and
tensor-parallel layers whose weight loaders slice the full Hugging Face tensors per rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from workers.engine.kernels import fused, rope_kernel
from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.layers.linear import (
    SINGLE_RANK,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    TPGroup,
)
from workers.engine.models.decoder import PagedDecoder, SwiGLUMLP, allocate, decoder_fields
from workers.engine.models.loader import fill_dummy_weights, iter_safetensors, normalize_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextSpec:
    """Shape and numerics of the language model, read from a checkpoint's config.json."""

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

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> TextSpec:
        """Parse either layout: LM fields at top level (original Qwen) or in ``text_config`` (transformers 5).

        RoPE settings come from ``rope_parameters`` (transformers 5) or ``rope_scaling`` +
        ``rope_theta`` (older configs, where the type is spelled ``"mrope"``).
        """
        fields, _, _ = decoder_fields(
            cfg, default_theta=1_000_000.0, default_section=(16, 24, 24), default_max_len=32768
        )
        nested: dict[str, Any] = cfg.get("text_config") or {}
        # transformers 5 keeps the flag at the root; pre-v5 saves put it in text_config. Either wins.
        tie = bool(cfg.get("tie_word_embeddings")) or bool(nested.get("tie_word_embeddings"))
        return TextSpec(tie_word_embeddings=tie, **fields)


class MRotaryEmbedding(nn.Module):
    """Multimodal RoPE: the rotary frequencies are split into sections fed by the t, h, w position rows.

    Frequency j (of head_dim/2) belongs to section i and is driven by position row i % 3; the
    result is duplicated over both halves of head_dim (the rotate_half layout).
    """

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...]) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        rows = [i % 3 for i, n in enumerate(mrope_section) for _ in range(n)]
        self.inv_freq: Tensor
        self.row_of_freq: Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("row_of_freq", torch.tensor(rows, dtype=torch.long), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions int64 [3, T] (or [T] for text only) -> float32 cos, sin of shape [T, head_dim]."""
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        # Pick each frequency's row first, then multiply: the same float32 products transformers forms.
        pos = positions[self.row_of_freq].t().float()  # [T, head_dim/2]
        freqs = pos * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rope_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """[T, D] cos, sin -> [T, 1, D] cos and sign-folded sin for ``apply_rope`` (once per forward).

    ``rotate_half(x) * sin`` equals ``swap_halves(x) * cat(-sin_lo, sin_hi)`` bit for bit (negation is
    exact and rounding is symmetric), so the negation moves out of the 28 layers into this one call.
    """
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.unsqueeze(1), signed.unsqueeze(1)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x [T, H, D]; cos, sin_signed [T, 1, D] from ``rope_tables``, in x's dtype.

    Same roundings as transformers' ``x * cos + rotate_half(x) * sin``, in four kernels instead of five.
    """
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * sin_signed


class Qwen2_5_VLAttention(nn.Module):
    def __init__(self, spec: TextSpec, tp: TPGroup) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size,
            spec.head_dim,
            spec.num_attention_heads,
            spec.num_key_value_heads,
            bias=True,
            tp=tp,
        )
        self.o_proj = RowParallelLinear(
            spec.num_attention_heads * spec.head_dim, spec.hidden_size, bias=False, tp=tp
        )
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.scale = spec.head_dim**-0.5
        self.fused = False  # CUDA: rope of q and k in one compiled kernel (fused.py)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.fused and fused.worth_it(qkv):
            rope = rope_kernel.lm_rope if rope_kernel.wanted(qkv, self.head_dim) else fused.compiled(fused.lm_rope)
            q, k, v = rope(qkv, cos, sin, self.q_size, self.kv_size, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(q.view(t, -1, self.head_dim), cos, sin)
            k = apply_rope(k.view(t, -1, self.head_dim), cos, sin)
            v = v.view(t, -1, self.head_dim)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, -1))


class Qwen2_5_VLDecoderLayer(nn.Module):
    def __init__(self, spec: TextSpec, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Qwen2_5_VLAttention(spec, tp)
        self.mlp = SwiGLUMLP(spec.hidden_size, spec.intermediate_size, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        h: Tensor,
        delta: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[Tensor, Tensor]:
        """(residual stream, previous layer's MLP output or None) -> the same pair after this layer.

        The MLP output is added to the stream by the *next* norm (``RMSNorm.add``), so on CUDA each residual
        add shares a kernel with the norm after it; the ops and their order are transformers' either way."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm.add(h, delta)
        h, x = self.post_attention_layernorm.add(h, self.self_attn(x, cos, sin, kv_cache, meta, backend))
        return h, self.mlp(x)


class Qwen2_5_VLLanguageModel(PagedDecoder):
    """The decoder stack over a flattened batch of new tokens with a paged KV cache."""

    def __init__(self, text_cfg: TextSpec, tp: TPGroup = SINGLE_RANK, attn_backend: str = "auto") -> None:
        super().__init__(text_cfg, tp, attn_backend)
        self.layers = nn.ModuleList(
            [Qwen2_5_VLDecoderLayer(text_cfg, tp) for _ in range(text_cfg.num_hidden_layers)]
        )
        self.add_head()
        self.rotary_emb = MRotaryEmbedding(text_cfg.head_dim, text_cfg.rope_theta, text_cfg.mrope_section)

    def forward(
        self,
        inputs_embeds: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend | None = None,
        deepstack: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """inputs_embeds [T, H], positions int64 [3, T] (t/h/w rows) -> final-norm hidden states [T, H].

        ``backend`` overrides the model's attention backend for this call (CUDA-graph decode uses a
        fixed-shape one). Qwen2.5-VL has no DeepStack: its image entries are the main embeddings alone."""
        if deepstack is not None:
            raise ValueError("Qwen2.5-VL takes no DeepStack features")
        self.check_kv_caches(kv_caches)
        backend = backend or self.attention_backend(inputs_embeds.device)
        cos, sin = self.rotary_emb(positions)
        cos, sin = rope_tables(cos.to(inputs_embeds.dtype), sin.to(inputs_embeds.dtype))
        h, delta = inputs_embeds, None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, delta = layer(h, delta, cos, sin, kv_cache, meta, backend)
        return self.final_norm(h, delta)


def build_language_model(
    spec: TextSpec,
    *,
    tp: TPGroup = SINGLE_RANK,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_backend: str = "auto",
) -> Qwen2_5_VLLanguageModel:
    """The LM allocated on ``device`` in ``dtype`` (weights not loaded: see models.base.load_model)."""
    return allocate(lambda: Qwen2_5_VLLanguageModel(spec, tp, attn_backend), dtype, device)


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
