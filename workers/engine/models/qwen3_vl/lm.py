"""glimpse's own Qwen3-VL language model, dense and MoE (decoder only).

Numerically it follows transformers' ``Qwen3VLTextModel`` / ``Qwen3VLMoeTextModel``: unlike Qwen2.5-VL, no
q/k/v bias, an RMSNorm over every q and k head before rotary, *interleaved* M-RoPE, DeepStack (vision
features added to the image rows after the first L layers) and, for MoE, sparse expert MLPs (moe.py).
Structurally it is the serving decoder of models/decoder.py, as the Qwen2.5-VL LM: flattened batch, paged KV cache
behind an attention backend, TP layers loading per-rank slices, residual adds deferred into the next norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from workers.engine.kernels import fused, rope_kernel
from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.kernels.skinny_gemm import Partials, settled
from workers.engine.layers.linear import SINGLE_RANK, RMSNorm, TPGroup
from workers.engine.layers.rotary import MRopeAngles, apply_rope, mrope_rows
from workers.engine.models.decoder import PagedDecoder
from workers.engine.models.decoder_layers import DecoderAttention, DecoderLayer, SwiGLUMLP
from workers.engine.models.decoder_spec import DecoderSpec, decoder_fields
from workers.engine.models.model_spec import text_fields
from workers.engine.models.qwen3_vl.moe import (
    SparseMoeBlock,
    expert_shard,
    expert_shards_needed,
    moe_fields,
)


@dataclass(frozen=True)
class TextSpec(DecoderSpec):
    """Shape and numerics of the language model, read from a checkpoint's config.json."""

    mrope_interleaved: bool
    attention_bias: bool = False
    num_experts: int = 0  # 0: dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def layer_is_sparse(self, layer: int) -> bool:
        """transformers' rule: every ``decoder_sparse_step``-th layer (1-based) is MoE unless listed dense."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> TextSpec:
        """Parse the whole config.json: LM fields in ``text_config`` (transformers 5) or at top level.

        RoPE comes from ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta``.
        """
        # Qwen3VLTextConfig defaults head_dim to 128; Qwen3VLMoeTextConfig derives it from the hidden size.
        moe = moe_fields(text_fields(cfg))
        fields, text, rope = decoder_fields(
            cfg, default_theta=500_000.0, default_section=(24, 20, 20), default_max_len=128_000,
            default_head_dim=None if moe["num_experts"] else 128,
        )
        nested: dict[str, Any] = cfg.get("text_config") or {}
        # transformers 5 reads the flag at the root (the MoE text_config even carries a contradicting default);
        # top-level-only layouts have it at the root too. text_config decides only when the root lacks it.
        tie = cfg["tie_word_embeddings"] if "tie_word_embeddings" in cfg else nested.get("tie_word_embeddings")
        return TextSpec(
            # transformers' Qwen3-VL always interleaves (it ignores the flag); every checkpoint says true.
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
            tie_word_embeddings=bool(tie),
            attention_bias=bool(text.get("attention_bias", False)),
            **fields,
            **moe,
        )


class RotaryTables(MRopeAngles):
    """positions [3, T] -> cos [T, 1, D] and sign-folded sin [T, 1, D] in ``dtype``, for every layer of a forward.

    As transformers' Qwen3-VL does: cos and sin of the float32 angles, cast, then duplicated over both halves of
    head_dim (the rotate_half layout); the sign of rotate_half is folded into sin (see ``apply_rope``)."""

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = self.angles(positions)  # [T, D/2]
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)  # transformers casts before duplicating
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)


def qwen3_qk_norm_rope(
    qkv: Tensor, q_w: Tensor, k_w: Tensor, eps: float, cos: Tensor, sin: Tensor, sizes: tuple[int, int, int]
) -> tuple[Tensor, Tensor, Tensor]:
    """CUDA (compiled, see fused.py): per-head RMSNorm + rotary of q and k in one pass, float32 in registers,
    rounded once. Eager spends ~11 kernels per tensor here; returns contiguous q, k, v [T, heads, D]."""
    q_size, kv_size, head_dim = sizes
    t = qkv.shape[0]
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)

    def norm_rotate(x: Tensor, weight: Tensor) -> Tensor:
        xf = x.reshape(t, -1, head_dim).float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        swapped = xf.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return (xf * cos.float() + swapped * sin.float()).to(x.dtype)

    return norm_rotate(q, q_w), norm_rotate(k, k_w), v.reshape(t, -1, head_dim).contiguous()


class Qwen3VLAttention(DecoderAttention):
    """Qwen3's attention: an RMSNorm over every q and k head before rotary, no q/k/v bias (unless configured)."""

    def __init__(self, spec: TextSpec, tp: TPGroup) -> None:
        super().__init__(spec, tp, qkv_bias=spec.attention_bias, o_bias=spec.attention_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)  # over head_dim, so replicated on every rank
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.sizes = (self.q_size, self.kv_size, spec.head_dim)

    def rotate(
        self, qkv: Tensor | Partials, cos: Tensor, sin: Tensor, cache: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The q and k norms, then rotary; on CUDA (``fused``) both in one kernel (rope_kernel.py, which also sums a
        split-K decode product's partials and writes k and v into ``cache`` where given; compiled where it is off)."""
        d = self.head_dim
        q_w, k_w, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        if self.fused and fused.worth_it(qkv) and rope_kernel.wanted(qkv, d):
            return rope_kernel.lm_rope(qkv, cos, sin, self.q_size, self.kv_size, d, (q_w, k_w, eps), cache=cache)
        qkv = settled(qkv)
        t = qkv.shape[0]
        if self.fused and fused.worth_it(qkv):
            out: tuple[Tensor, Tensor, Tensor] = fused.compiled(qwen3_qk_norm_rope)(
                qkv, q_w, k_w, eps, cos, sin, self.sizes
            )
            return out
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(self.q_norm(q.view(t, -1, d)), cos, sin)
        k = apply_rope(self.k_norm(k.view(t, -1, d)), cos, sin)
        return q, k, v.view(t, -1, d)


def _layer(spec: TextSpec, layer: int, tp: TPGroup) -> DecoderLayer:
    mlp: nn.Module
    if spec.layer_is_sparse(layer):
        mlp = SparseMoeBlock(
            spec.hidden_size, spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size, tp
        )
    else:
        mlp = SwiGLUMLP(spec.hidden_size, spec.intermediate_size, tp)
    return DecoderLayer(Qwen3VLAttention(spec, tp), mlp, spec.hidden_size, spec.rms_norm_eps)


class Qwen3VLLanguageModel(PagedDecoder):
    """The decoder stack over a flattened batch of new tokens with a paged KV cache."""

    def __init__(self, spec: TextSpec, tp: TPGroup = SINGLE_RANK, attn_backend: str = "auto") -> None:
        super().__init__(spec, tp, attn_backend)
        self.layers = nn.ModuleList(_layer(spec, i, tp) for i in range(spec.num_hidden_layers))
        self.add_head()
        rows = mrope_rows(spec.mrope_section, spec.mrope_interleaved)
        self.rotary = RotaryTables(spec.head_dim, spec.rope_theta, rows)

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

        ``deepstack`` = (rows int64 [N] of image tokens in this batch, features [N, L*H]): level i is added
        to those rows after decoder layer i. ``backend`` overrides the model's attention backend (CUDA-graph
        decode uses a fixed-shape one)."""
        backend, cos, sin = self.prepare(inputs_embeds, positions, kv_caches, backend)
        hidden = self.spec.hidden_size
        rows, feats, levels = None, None, 0
        if deepstack is not None and deepstack[0].numel():
            rows, feats = deepstack
            levels = feats.shape[-1] // hidden
            if feats.shape != (rows.shape[0], levels * hidden) or not 0 < levels <= len(self.layers):
                raise ValueError(
                    f"deepstack features {tuple(feats.shape)} for {rows.shape[0]} rows: need [N, L*{hidden}]"
                )
            feats = feats.to(inputs_embeds.dtype)
        h, delta = inputs_embeds, None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h, delta = layer(h, delta, cos, sin, kv_cache, meta, backend)
            if i < levels and rows is not None and feats is not None:
                # transformers adds the layer output to the stream, then the features to the image rows;
                # materialising the deferred add keeps that order (and its rounding). Rows are distinct, so
                # index_add_ is one h + f per row.
                h, delta = h + settled(delta), None
                h.index_add_(0, rows, feats[:, i * hidden : (i + 1) * hidden])
        return self.final_norm(h, delta)

    def route(self, name: str) -> tuple[str, object]:
        """Experts load from fused 3-D tensors (either layout, see moe.py) or per-expert 2-D ones."""
        routed = expert_shard(name)
        return routed if routed is not None else super().route(name)

    def shards_needed(self, param: str) -> int:
        needed = expert_shards_needed(param, self.spec.num_experts)
        return needed if needed != 1 else super().shards_needed(param)


build_language_model = Qwen3VLLanguageModel.build
