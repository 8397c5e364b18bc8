"""glimpse's Gemma 4 language model (31B dense, 26B-A4B MoE, E2B / E4B with per-layer inputs), behind the LM seam.

It follows transformers' ``Gemma4TextModel`` as ``Gemma4Model`` drives it:
- token rows: the scaled embedding (sqrt(hidden) cast to the weight dtype), and with per-layer inputs (PLE) the
  scaled per-layer lookup beside it, [T, hidden + layers * ple]. Ids past the vocabulary (glimpse's image pads) and
  the multimodal placeholder ids are embedded as the pad token, as transformers replaces them before both lookups;
  the runner then overwrites the first ``hidden`` columns of image rows with image features, and ``forward`` builds
  the per-layer inputs from those spliced rows (transformers' ``project_per_layer_inputs``);
- each layer: attention and MLP each between a pre-norm and a post-norm, added to the residual; the 26B-A4B's
  routed experts beside the dense MLP (moe.py), each with its own norms; then the per-layer input's gated
  projection (PLE) and the layer's ``layer_scalar``;
- logits through the (tied) head, then ``final_logit_softcapping``.

KV caches: one per layer that owns its K/V (``TextSpec.kv_owner_layers``; shapes differ between sliding and full
layers, ``TextSpec.kv_shapes``); a KV-shared layer attends over its store layer's cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.layers.linear import (
    SINGLE_RANK,
    MergedColumnParallelLinear,
    ParallelLMHead,
    TPGroup,
    VocabParallelEmbedding,
    kv_heads_per_rank,
)
from workers.engine.models.decoder import PagedDecoder
from workers.engine.models.gemma4.lm_layers import (
    GemmaAttention,
    GemmaMLP,
    GemmaQKVLinear,
    GemmaRMSNorm,
    GemmaRotary,
    lm_add_norm,
    lm_add_norm_scale,
    lm_norm_sum,
)
from workers.engine.models.gemma4.moe import GemmaExperts, GemmaRouter, beside_experts, side_stream
from workers.engine.models.gemma4.spec import TextSpec, check_tp
from workers.engine.models.gemma4.vision_layers import fused_call
from workers.engine.models.qwen3_vl.moe import expert_shard, expert_shards_needed

# Checkpoint projections that live inside a fused parameter: (checkpoint part, fused part, shard id).
FUSED_PROJECTIONS: tuple[tuple[str, str, str | int], ...] = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
)
# What a KV-shared layer's checkpoint may still carry (transformers ignores it on load): it computes no K/V.
SHARED_LAYER_UNUSED = (".self_attn.k_proj.", ".self_attn.v_proj.", ".self_attn.k_norm.", ".self_attn.v_norm.")


class GemmaTokenEmbedding(VocabParallelEmbedding):
    """ids [T] -> token rows [T, hidden (+ layers * ple)]: the main table is this module's ``weight`` (vocab-parallel,
    shared with a tied head), the per-layer-input table ``per_layer``."""

    def __init__(self, spec: TextSpec, tp: TPGroup) -> None:
        super().__init__(spec.vocab_size, spec.hidden_size, tp)
        self.pad_token_id = spec.pad_token_id
        self.embed_scale: Tensor
        self.per_layer_scale: Tensor
        self.placeholders: Tensor
        # float32 scalars, cast to the table's dtype on use (transformers' Gemma4TextScaledWordEmbedding).
        self.register_buffer("embed_scale", torch.tensor(spec.hidden_size**0.5, dtype=torch.float32), persistent=False)
        ids = [t for t in spec.placeholder_token_ids if t < spec.vocab_size]
        self.register_buffer("placeholders", torch.tensor(ids, dtype=torch.long), persistent=False)
        self.per_layer: VocabParallelEmbedding | None = None
        if spec.hidden_size_per_layer_input:
            self.per_layer = VocabParallelEmbedding(spec.vocab_size_per_layer_input, spec.per_layer_width, tp)
            scale = torch.tensor(spec.hidden_size_per_layer_input**0.5, dtype=torch.float32)
            self.register_buffer("per_layer_scale", scale, persistent=False)

    def text_ids(self, input_ids: Tensor) -> Tensor:
        """Image pads (>= vocab) and multimodal placeholders -> the pad token."""
        other = input_ids >= self.num_embeddings
        if self.placeholders.numel():
            other |= torch.isin(input_ids, self.placeholders)
        return torch.where(other, self.pad_token_id, input_ids)

    def forward(self, input_ids: Tensor) -> Tensor:
        ids = self.text_ids(input_ids)
        rows = super().forward(ids) * self.embed_scale.to(self.weight.dtype)
        if self.per_layer is None:
            return rows
        per_layer = self.per_layer(ids) * self.per_layer_scale.to(self.per_layer.weight.dtype)
        return torch.cat([rows, per_layer], dim=-1)


class GemmaDecoderLayer(nn.Module):
    """One decoder layer (module names are the checkpoint's)."""

    def __init__(self, spec: TextSpec, layer: int, tp: TPGroup) -> None:
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.tp = tp
        self.self_attn = GemmaAttention(spec, layer, tp)
        self.mlp = GemmaMLP(h, spec.mlp_width(layer), tp)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.has_per_layer_input = spec.hidden_size_per_layer_input > 0
        if self.has_per_layer_input:
            ple = spec.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(h, ple, bias=False)  # small: replicated on every rank
            self.per_layer_projection = nn.Linear(ple, h, bias=False)
            self.post_per_layer_input_norm = GemmaRMSNorm(h, eps)
        self.has_experts = spec.num_experts > 0
        if self.has_experts:
            self.router = GemmaRouter(h, spec.num_experts, spec.top_k_experts, eps)
            self.experts = GemmaExperts(spec.num_experts, h, spec.moe_intermediate_size, tp)
            self.post_feedforward_layernorm_1 = GemmaRMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
        for p in self.parameters():
            p.requires_grad_(False)
        self.fused = False  # CUDA: the post-norms with their residual adds as compiled kernels (lm_layers.py)

    def forward(
        self,
        h: Tensor,
        per_layer_input: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> Tensor:
        on, eps = self.fused, self.input_layernorm.eps
        attn = self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta, backend)
        h = fused_call(on, lm_add_norm, h, attn, self.post_attention_layernorm.weight, eps)
        if self.has_experts and beside_experts(h, self.tp):
            # A decode step's dense MLP on a side stream while the experts run: both are too small to fill the
            # card's bandwidth alone (moe.py). The fork and join become edges of the step's CUDA graph.
            main, side = torch.cuda.current_stream(h.device), side_stream(h.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                mlp = self.mlp(self.pre_feedforward_layernorm(h))
            routed = self.routed(h)
            main.wait_stream(side)
        else:
            mlp = self.mlp(self.pre_feedforward_layernorm(h))
            routed = self.routed(h) if self.has_experts else mlp
        if self.has_experts:
            mlp = fused_call(on, lm_norm_sum, mlp, routed, self.post_feedforward_layernorm_1.weight,
                             self.post_feedforward_layernorm_2.weight, eps)  # fmt: skip
        if per_layer_input is None:
            return fused_call(on, lm_add_norm_scale, h, mlp, self.post_feedforward_layernorm.weight, eps,
                              self.layer_scalar)  # fmt: skip
        h = fused_call(on, lm_add_norm, h, mlp, self.post_feedforward_layernorm.weight, eps)
        gate = F.gelu(F.linear(h, self.per_layer_input_gate.weight), approximate="tanh") * per_layer_input
        h = fused_call(on, lm_add_norm, h, F.linear(gate, self.per_layer_projection.weight),
                       self.post_per_layer_input_norm.weight, eps)  # fmt: skip
        return h * self.layer_scalar


    def routed(self, h: Tensor) -> Tensor:
        """The routed experts' sum over all ranks. The router and the experts read the residual stream after
        attention, not the dense MLP's input."""
        weights, ids = self.router(h)
        return self.tp.all_reduce(self.experts(self.pre_feedforward_layernorm_2(h), weights, ids))


class Gemma4LanguageModel(PagedDecoder):
    """The decoder stack over a flattened batch of new tokens with paged KV caches (see the module docstring). From
    PagedDecoder: allocation, the attention backend, weight loading and its completeness check."""

    spec: TextSpec

    def __init__(self, spec: TextSpec, tp: TPGroup = SINGLE_RANK, attn_backend: str = "auto") -> None:
        check_tp(spec, tp.size)
        super().__init__(spec, tp, attn_backend, embed_tokens=GemmaTokenEmbedding(spec, tp))
        self.layers = nn.ModuleList(GemmaDecoderLayer(spec, i, tp) for i in range(spec.num_hidden_layers))
        if spec.hidden_size_per_layer_input:
            # transformers' project_per_layer_inputs: replicated (its input, the token rows, is the same on every rank).
            self.per_layer_model_projection = nn.Linear(spec.hidden_size, spec.per_layer_width, bias=False)
            self.per_layer_model_projection.weight.requires_grad_(False)
            self.per_layer_projection_norm = GemmaRMSNorm(spec.hidden_size_per_layer_input, spec.rms_norm_eps)
        # transformers' Gemma RMSNorm (its own float32 form), where PagedDecoder.add_head would put the shared one.
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)  # type: ignore[assignment]
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # same vocab sharding, so one shard serves both
        self.rotary = GemmaRotary(spec)
        self.cache_index = [spec.cache_index(i) for i in range(spec.num_hidden_layers)]
        self._shards = self._fused_shards()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The first KV cache's shape on this rank (the others: ``kv_cache_shapes``)."""
        return self.kv_cache_shapes(num_blocks, block_size)[0]

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """Every KV cache's shape on this rank, ``[2, num_blocks, block_size, kv_heads_local, head_dim]``, in kv_caches
        order (the same as ModelSpec.kv_cache_shapes with this TP size)."""
        heads = [kv_heads_per_rank(kv, self.tp.size) for kv, _ in self.spec.kv_shapes()]
        return [(2, num_blocks, block_size, h, d) for h, (_, d) in zip(heads, self.spec.kv_shapes(), strict=True)]

    def per_layer_inputs(self, hidden: Tensor, token_part: Tensor) -> Tensor:
        """transformers' project_per_layer_inputs: the spliced rows' projection (scaled, normed per layer) plus the
        token-identity lookup, times 1/sqrt(2) -> [T, layers, ple]."""
        spec = self.spec
        shape = (hidden.shape[0], spec.num_hidden_layers, spec.hidden_size_per_layer_input)
        projection = F.linear(hidden, self.per_layer_model_projection.weight) * spec.hidden_size**-0.5
        projection = self.per_layer_projection_norm(projection.reshape(shape))
        return (projection + token_part.reshape(shape)) * 2.0**-0.5

    def forward(
        self,
        inputs_embeds: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend | None = None,
        deepstack: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """inputs_embeds [T, token_row_width] (``embed_tokens`` rows, images spliced into the first ``hidden`` columns),
        positions int64 [3, T] (Gemma's positions are 1-D: row 0) or [T] -> final-norm hidden states [T, hidden].

        ``kv_caches``: one per KV-owning layer, in layer order. ``backend`` overrides the model's for this call."""
        if deepstack is not None:
            raise ValueError("Gemma 4 takes no DeepStack features")
        if len(kv_caches) != self.spec.kv_layers:
            raise ValueError(f"expected {self.spec.kv_layers} KV caches (one per KV-owning layer), got {len(kv_caches)}")
        backend = backend or self.attention_backend(inputs_embeds.device)
        hidden = self.spec.hidden_size
        h = inputs_embeds[:, :hidden]
        per_layer = self.per_layer_inputs(h, inputs_embeds[:, hidden:]) if self.spec.hidden_size_per_layer_input else None
        tables = self.rotary(positions[0] if positions.dim() == 2 else positions, h.dtype)
        for i, layer in enumerate(self.layers):
            cos, sin = tables[self.spec.layer_types[i]]
            layer_input = per_layer[:, i] if per_layer is not None else None
            # Sliding layers read and write the window pool's caches through its tables when the worker keeps one.
            layer_meta = meta.window if meta.window is not None and self.spec.is_sliding(i) else meta
            h = layer(h, layer_input, cos, sin, kv_caches[self.cache_index[i]], layer_meta, backend)
        out: Tensor = self.norm(h)
        return out

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, H] -> float32 logits [N, vocab], gathered over TP ranks, softcapped in the model dtype as
        transformers does (logits / cap, tanh, * cap)."""
        logits = self.tp.all_gather(self.lm_head(hidden), dim=-1)[..., : self.spec.vocab_size]
        cap = self.spec.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    # ---- weights ----------------------------------------------------------------------------------
    def route(self, name: str) -> tuple[str, object]:
        """Checkpoint name (without ``lm.``) -> (parameter name, shard id for its weight loader)."""
        if name == "embed_tokens_per_layer.weight":
            return "embed_tokens.per_layer.weight", None
        for part, fused_part, shard_id in FUSED_PROJECTIONS:
            if part in name:
                return name.replace(part, fused_part), shard_id
        routed = expert_shard(name)
        return routed if routed is not None else (name, None)

    def unused(self, name: str) -> bool:
        """Checkpoint tensors that transformers ignores too: a tied head's copy, a KV-shared layer's K/V weights."""
        if name.startswith("layers.") and any(part in name for part in SHARED_LAYER_UNUSED):
            return not self.spec.owns_kv(int(name.split(".")[1]))
        return super().unused(name)

    def shards_needed(self, param: str) -> int:
        return self._shards.get(param, 1)

    def _fused_shards(self) -> dict[str, int]:
        """Parameters made of several checkpoint tensors and how many: the fused projections' parts, the experts'."""
        shards: dict[str, int] = {}
        for prefix, module in self.named_modules():
            if isinstance(module, GemmaQKVLinear):
                shards[f"{prefix}.weight"] = len(module.parts)
            elif isinstance(module, MergedColumnParallelLinear):
                shards[f"{prefix}.weight"] = len(module.output_sizes)
            elif isinstance(module, GemmaExperts):
                for part in ("gate_up_proj", "down_proj"):
                    shards[f"{prefix}.{part}"] = expert_shards_needed(f"{prefix}.{part}", module.num_experts)
        return shards


build_language_model = Gemma4LanguageModel.build
