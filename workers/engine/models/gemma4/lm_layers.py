"""The pieces of Gemma 4's decoder layer: its RMSNorm, the rotary tables of each layer kind, attention over the paged
KV cache (own or shared) and the GELU MLP.

Numerics follow transformers' ``modeling_gemma4`` op for op in the model dtype:
- ``Gemma4RMSNorm``: float32 x * (mean(x^2) + eps)^-0.5 (a pow, not rsqrt: transformers picks pow to match JAX, and
  the two differ in the last bit), times the float32 weight as stored (no 1 + w), cast back; q, k and v are each
  normed per head (v without a weight);
- attention scale 1.0 (the q/k norms stand in for 1/sqrt(d)); with ``attention_k_eq_v`` a full layer's V is K's
  projection before K's norm and rotary;
- rotary per layer kind from transformers' init functions (spec.py's ``RopeSpec``); a proportional table rotates the
  first frequencies over the whole head (rotate_half pairs dim i with i + D/2) and leaves the zero-frequency pairs
  as they are (cos 1, sin 0: exact).

On CUDA, with ``fused`` set (fused.enable), each run of elementwise work between two GEMMs (a norm, a norm and the
rotary, GELU * up, a post-norm and its residual add) is one compiled kernel (fused.py) instead of three to nine
eager ones: a layer has up to eleven norms, and at batch 1 the decode step is their launches. The eager functions
below are the reference and what the CPU runs, op for op as before.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    divide,
    kv_heads_per_rank,
)
from workers.engine.layers.rotary import apply_rope
from workers.engine.models.gemma4.spec import TextSpec
from workers.engine.models.gemma4.vision_layers import fused_call, vit_gelu_mul, vit_rms_norm


def lm_norm_rope(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """q or k [T, H, D]: the per-head RMSNorm, then the layer kind's rotary."""
    return apply_rope(vit_rms_norm(x, weight, eps), cos, sin)


def lm_add_norm(h: Tensor, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """A sublayer's post-norm added to the residual: ``h + norm(x)``."""
    return h + vit_rms_norm(x, weight, eps)


def lm_norm_sum(a: Tensor, b: Tensor, weight_a: Tensor, weight_b: Tensor, eps: float) -> Tensor:
    """The MoE layer's dense and routed outputs, each post-normed, summed: ``norm_a(a) + norm_b(b)``."""
    return vit_rms_norm(a, weight_a, eps) + vit_rms_norm(b, weight_b, eps)


def lm_router_input(h: Tensor, scale: Tensor, root: float, eps: float) -> Tensor:
    """The MoE router's input: the residual stream normed without a weight, times its learned scale and 1/sqrt(H)."""
    return vit_rms_norm(h, None, eps) * scale * root


def lm_add_norm_scale(h: Tensor, x: Tensor, weight: Tensor, eps: float, scalar: Tensor) -> Tensor:
    """The feed-forward's post-norm added to the residual, times the layer's scalar: ``(h + norm(x)) * scalar``."""
    return (h + vit_rms_norm(x, weight, eps)) * scalar


class GemmaRMSNorm(nn.Module):
    """transformers' Gemma4RMSNorm (see the module docstring); ``with_scale=False`` has no weight at all."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight: nn.Parameter | None = (
            nn.Parameter(torch.ones(dim), requires_grad=False) if with_scale else None
        )

        self.fused = False

    def forward(self, x: Tensor) -> Tensor:
        return fused_call(self.fused, vit_rms_norm, x, self.weight, self.eps)


class GemmaRotary(nn.Module):
    """Positions [T] -> per layer kind, the cos and sign-folded sin tables [T, 1, D] (layers/rotary.py's
    ``apply_rope``) in the model dtype, built once per forward for all layers of that kind."""

    def __init__(self, spec: TextSpec) -> None:
        super().__init__()
        self.kinds = sorted(set(spec.layer_types))
        device = torch.empty(0).device  # the device the model is being allocated on
        for kind in self.kinds:
            head_dim = spec.layer_head_dims[spec.layer_types.index(kind)]
            with torch.device("cpu"):  # as transformers: the frequencies are computed on the host, then moved
                inv_freq = spec.rope(kind).inv_freq(head_dim)
            self.register_buffer(f"{kind}_inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        tables = {}
        for kind in self.kinds:
            inv_freq: Tensor = getattr(self, f"{kind}_inv_freq")
            freqs = positions[:, None].float() * inv_freq.float()
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            half = freqs.shape[-1]
            tables[kind] = cos[:, None], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None]
        return tables


class GemmaQKVLinear(QKVParallelLinear):
    """q and this layer's own k / v in one column-parallel matmul, heads split over ranks (KV heads replicated where
    fewer than the ranks). ``parts``: "qkv", "qk" (``attention_k_eq_v``: V is K's projection) or "q" (a KV-shared
    layer: it reads another layer's cache)."""

    def __init__(self, hidden_size: int, head_dim: int, heads: int, kv_heads: int, parts: str, tp: TPGroup) -> None:
        self.parts = parts
        self.head_dim = head_dim
        self.num_heads = heads
        self.num_kv_heads = kv_heads
        self.num_heads_local = divide(heads, tp.size)
        self.num_kv_heads_local = kv_heads_per_rank(kv_heads, tp.size)
        self.q_size = self.num_heads_local * head_dim
        self.kv_size = self.num_kv_heads_local * head_dim
        local = self.q_size + (len(parts) - 1) * self.kv_size
        # QKVParallelLinear's own __init__ sizes for q + 2 kv: skip to the column-parallel base with this width.
        ColumnParallelLinear.__init__(self, hidden_size, local * tp.size, bias=False, tp=tp)

    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
        if shard_id not in tuple(self.parts):
            raise KeyError(f"this attention has no {shard_id!r} projection (its parts: {self.parts!r})")
        super().weight_loader(param, loaded, shard_id)


class GemmaAttention(nn.Module):
    """One layer's attention. A layer that owns its KV writes this step's K/V into its cache and attends; a KV-shared
    layer only projects q and attends over its store layer's cache (written earlier in the same forward)."""

    def __init__(self, spec: TextSpec, layer: int, tp: TPGroup) -> None:
        super().__init__()
        d = self.head_dim = spec.layer_head_dims[layer]
        heads = spec.num_attention_heads
        self.owns_kv = spec.owns_kv(layer)
        sliding = spec.is_sliding(layer)
        parts = "q" if not self.owns_kv else "qk" if spec.attention_k_eq_v and not sliding else "qkv"
        self.qkv_proj = GemmaQKVLinear(spec.hidden_size, d, heads, spec.layer_kv_heads[layer], parts, tp)
        self.o_proj = RowParallelLinear(heads * d, spec.hidden_size, bias=False, tp=tp)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.q_norm = GemmaRMSNorm(d, spec.rms_norm_eps)
        if self.owns_kv:
            self.k_norm = GemmaRMSNorm(d, spec.rms_norm_eps)
            self.v_norm = GemmaRMSNorm(d, spec.rms_norm_eps, with_scale=False)
        self.window = spec.window(layer)
        # transformers (create_masks_for_vision_model): image tokens see each other on sliding layers only.
        self.bidirectional = sliding and spec.bidirectional_vision
        self.fused = False

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, meta: AttentionMetadata, backend: AttentionBackend
    ) -> Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        eps = self.q_norm.eps
        q = fused_call(self.fused, lm_norm_rope, qkv[:, : self.q_size].view(t, -1, d), self.q_norm.weight, eps, cos, sin)
        k = v = None
        if self.owns_kv:
            k_raw = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, -1, d)
            v_raw = qkv[:, self.q_size + self.kv_size :].view(t, -1, d) if self.qkv_proj.parts == "qkv" else k_raw
            k = fused_call(self.fused, lm_norm_rope, k_raw, self.k_norm.weight, eps, cos, sin)
            v = self.v_norm(v_raw)
        bidirectional = self.bidirectional and meta.bidir_spans is not None
        out = backend.forward(q, k, v, kv_cache, meta, 1.0, window=self.window, bidirectional=bidirectional)
        result: Tensor = self.o_proj(out.reshape(t, -1))
        return result


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up in one column-parallel matmul, down row-parallel (all-reduced)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=False, tp=tp
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, tp=tp)
        self.fused = False

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out: Tensor = self.down_proj(fused_call(self.fused, vit_gelu_mul, gate, up))
        return out
