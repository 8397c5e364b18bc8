"""glimpse's Qwen3.5 / Qwen3.5-MoE language model: a hybrid decoder whose layers mix Gated DeltaNet linear attention
(linear_attention.py; per-sequence recurrent state in slot pools) with gated full attention over the paged KV cache.

Numerically it follows transformers' ``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel``:
- every RMSNorm of the decoder (input / post-attention / final, and the per-head q and k norms) is zero-centred,
  x_normed * (1 + weight); the 1 is added once at load (in float32, as transformers adds it), so the shared RMSNorm
  and its fused CUDA kernels apply it as a plain weight;
- full attention: ``q_proj`` gives each head's query and an output gate side by side ([query D | gate D] per
  head), per-head q/k norms, rotary on the first ``rotary_dim`` dims of each head only (interleaved M-RoPE over
  that part), and the attention output times sigmoid(gate) before ``o_proj``;
- MLPs dense SwiGLU (Qwen3.5) or routed experts plus a gated shared expert in every layer (moe.py).

Structurally it is the serving decoder of models/decoder.py: flattened batch, residual adds deferred into the next
norm, TP layers loading per-rank slices. ``kv_caches`` holds one cache per full-attention layer only, in layer order.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from workers.engine.kernels import fused, hybrid_kernels
from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.kernels.fused import gated_output, qk_norm_partial_rope
from workers.engine.kernels.skinny_gemm import Partials
from workers.engine.layers.linear import (
    SINGLE_RANK,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    TPGroup,
    copy_into,
    set_weight_loader,
)
from workers.engine.layers.rotary import apply_rope, mrope_rows
from workers.engine.models.decoder import PagedDecoder
from workers.engine.models.decoder_layers import DecoderLayer, SwiGLUMLP, sum_in_next_norm
from workers.engine.models.qwen3_5.linear_attention import IN_PROJ_PARTS, GatedDeltaNet
from workers.engine.models.qwen3_5.moe import SHARED_EXPERT_PARTS, SharedExpertMoeBlock
from workers.engine.models.qwen3_5.spec import FULL, TextSpec, check_tp
from workers.engine.models.qwen3_vl.lm import RotaryTables
from workers.engine.models.qwen3_vl.moe import expert_shard, expert_shards_needed


def load_zero_centred(param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
    """A zero-centred norm's checkpoint weight w, stored as 1 + w: computed in float32 as transformers computes
    (1.0 + w.float()) on every forward, then cast to the parameter's dtype."""
    copy_into(param, loaded.float() + 1.0, "norm weight")


class GatedAttention(nn.Module):
    """Qwen3.5's full attention: GQA over the paged KV cache with a sigmoid output gate per query dim, zero-centred
    q/k norms and partial rotary. q (with its gate), k and v come from one column-parallel matmul, heads split over
    the ranks; the query part's rows are whole heads of [query | gate], so each rank's slice keeps them together."""

    def __init__(self, spec: TextSpec, tp: TPGroup) -> None:
        super().__init__()
        d = spec.head_dim
        self.head_dim, self.rotary_dim = d, spec.rotary_dim
        heads = spec.num_attention_heads
        # Twice the heads of width D: the q part's rows are each head's query then its gate, as q_proj stores them.
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, d, 2 * heads, spec.num_key_value_heads, bias=False, tp=tp)
        self.o_proj = RowParallelLinear(heads * d, spec.hidden_size, bias=False, tp=tp)
        self.q_gate_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)  # over head_dim: replicated on every rank
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.scale = d**-0.5
        self.fused = False  # CUDA: the norms + rotary and the output gate fused (fused.py's sites); set by fused.enable

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotary on each head's first ``rotary_dim`` dims; the rest pass through."""
        r = self.rotary_dim
        if r == self.head_dim:
            return apply_rope(x, cos, sin)
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, meta: AttentionMetadata, backend: AttentionBackend
    ) -> Tensor:
        t, d = x.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(x).split([self.q_gate_size, self.kv_size, self.kv_size], dim=-1)
        q_gate = q_gate.view(t, -1, 2 * d)
        q, gate, k = q_gate[..., :d], q_gate[..., d:], k.view(t, -1, d)
        fuse = self.fused and fused.worth_it(x)
        # CUDA: hybrid_kernels.py's kernels, else the compiled sites (its switch off or its probe failed)
        kernels = fuse and hybrid_kernels.wanted(x)
        if fuse:
            prep = hybrid_kernels.qk_norm_partial_rope if kernels else fused.compiled(qk_norm_partial_rope)
            q, k = prep(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin, self.rotary_dim)
        else:
            q = self.rotate(self.q_norm(q), cos, sin)
            k = self.rotate(self.k_norm(k), cos, sin)
        out = backend.forward(q, k, v.view(t, -1, d), kv_cache, meta, self.scale)
        gate_mul = hybrid_kernels.gated_output if kernels else fused.compiled(gated_output) if fuse else gated_output
        gated: Tensor = gate_mul(out, gate)
        result: Tensor = self.o_proj(gated)
        return result


class LinearDecoderLayer(nn.Module):
    """A pre-norm decoder layer whose token mixer is Gated DeltaNet (``linear_attn``, as the checkpoint names it);
    same residual scheme as DecoderLayer, no KV cache."""

    def __init__(self, linear_attn: GatedDeltaNet, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.linear_attn = linear_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        sum_in_next_norm(mlp)

    def forward(
        self, h: Tensor, delta: Tensor | Partials | None, meta: AttentionMetadata, backend: AttentionBackend | None = None
    ) -> tuple[Tensor, Tensor | Partials]:
        if delta is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm.add(h, delta)
        h, x = self.post_attention_layernorm.add(h, self.linear_attn(x, meta, backend))
        out: Tensor | Partials = self.mlp(x)
        return h, out


def _mlp(spec: TextSpec, tp: TPGroup) -> nn.Module:
    if spec.num_experts:
        return SharedExpertMoeBlock(
            spec.hidden_size, spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size,
            spec.shared_expert_intermediate_size, tp,
        )
    return SwiGLUMLP(spec.hidden_size, spec.intermediate_size, tp)


def _layer(spec: TextSpec, kind: str, tp: TPGroup) -> nn.Module:
    if kind == FULL:
        return DecoderLayer(GatedAttention(spec, tp), _mlp(spec, tp), spec.hidden_size, spec.rms_norm_eps)
    return LinearDecoderLayer(GatedDeltaNet(spec, tp), _mlp(spec, tp), spec.hidden_size, spec.rms_norm_eps)


class Qwen3_5LanguageModel(PagedDecoder):
    """The hybrid decoder stack over a flattened batch of new tokens: paged KV for the full-attention layers, slot
    pools of recurrent state for the linear-attention ones (``allocate_state``; ``meta.state`` names each sequence's
    slot)."""

    def __init__(self, spec: TextSpec, tp: TPGroup = SINGLE_RANK, attn_backend: str = "auto") -> None:
        check_tp(spec, tp.size)
        super().__init__(spec, tp, attn_backend)
        self.layers = nn.ModuleList(_layer(spec, kind, tp) for kind in spec.layer_types)
        self.add_head()
        self.rotary = RotaryTables(spec.rotary_dim, spec.rope_theta, mrope_rows(spec.mrope_section, True))
        # Every RMSNorm of this decoder is zero-centred (the gated norm inside Gated DeltaNet is not an RMSNorm).
        for module in self.modules():
            if isinstance(module, RMSNorm):
                set_weight_loader(module.weight, load_zero_centred)
        self.num_kv_layers = len(spec.full_layers)
        self.state_pools: list[Tensor] = []

    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.layers if isinstance(layer, LinearDecoderLayer)]

    def allocate_state(self, num_slots: int, dtype: torch.dtype) -> list[Tensor]:
        """Zeroed state pools of every linear-attention layer (conv [num_slots, conv_dim_local, K-1], then recurrent
        [num_slots, Hv_local, Dk, Dv], layer by layer) on the LM's device, bound to the layers for later forwards
        (any pools bound before are dropped). The runner copies slots over the returned list (``t[dst] = t[src]``)."""
        device = self.embed_tokens.weight.device
        self.state_pools = [p for mixer in self.linear_layers() for p in mixer.allocate_state(num_slots, dtype, device)]
        return self.state_pools

    def check_kv_caches(self, kv_caches: list[Tensor]) -> None:
        if len(kv_caches) != self.num_kv_layers:
            raise ValueError(f"expected {self.num_kv_layers} KV caches (one per full-attention layer), got {len(kv_caches)}")

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

        ``kv_caches``: one per full-attention layer, in layer order. ``meta.state`` gives each sequence's slot in the
        linear-attention layers' pools, whether it starts from zeros, and the snapshots to take."""
        if deepstack is not None:
            raise ValueError("Qwen3.5 takes no DeepStack features")
        backend, cos, sin = self.prepare(inputs_embeds, positions, kv_caches, backend)
        caches = iter(kv_caches)
        h, delta = inputs_embeds, None
        for layer in self.layers:
            if isinstance(layer, LinearDecoderLayer):
                h, delta = layer(h, delta, meta, backend)
            else:
                h, delta = layer(h, delta, cos, sin, next(caches), meta, backend)
        return self.final_norm(h, delta)

    # ---- weights ----------------------------------------------------------------------------------
    def route(self, name: str) -> tuple[str, object]:
        """Checkpoint name -> (parameter, shard id): the fused linear-attention input projection, the shared expert's
        gate/up, routed experts in any layout (qwen3_vl/moe.py), then the decoder's q/k/v and gate/up."""
        for part, shard in IN_PROJ_PARTS:
            if part in name:
                return name.replace(part, ".linear_attn.in_proj."), shard
        for part, fused_part, index in SHARED_EXPERT_PARTS:
            if part in name:
                return name.replace(part, fused_part), index
        routed = expert_shard(name)
        return routed if routed is not None else super().route(name)

    def shards_needed(self, param: str) -> int:
        if ".linear_attn.in_proj." in param:
            return len(IN_PROJ_PARTS)
        needed = expert_shards_needed(param, self.spec.num_experts)
        return needed if needed != 1 else super().shards_needed(param)


build_language_model = Qwen3_5LanguageModel.build
