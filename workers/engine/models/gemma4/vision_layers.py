"""The layers of Gemma 4's vision encoder: RMSNorm (with and without scale), the clippable linear, the axial 2-D rotary,
self-attention with q/k/v norms over whole images, the gated MLP and the sandwich-normed encoder layer.

Numerics follow transformers' ``modeling_gemma4`` op for op (float32 on the CPU is compared with it to 1e-5): norms
compute in float32 and cast back, the rotary runs in the activations' dtype with cos/sin cast to it, attention has
scale 1 (the q/k norms stand in for 1/sqrt(d)). On CUDA, with ``fused`` set (fused.enable), the elementwise runs
between GEMMs are compiled into single kernels that round once; the eager code stays the reference.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.kernels import fused
from workers.engine.layers.vision_attention import Segments, varlen_attn, varlen_available
from workers.engine.models.qwen_vit import activation


@cache
def varlen_takes_scale() -> bool:
    """FlashAttention varlen serves here only where it takes an explicit softmax scale (Gemma's is 1, not
    1/sqrt(d)). Asked on first use: looking varlen up imports torch._dynamo (layers/vision_attention.py)."""
    found = varlen_attn()
    return found is not None and "scale" in inspect.signature(found).parameters


def vit_rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """transformers' Gemma4RMSNorm: float32, ``x * pow(mean(x^2) + eps, -0.5)`` (pow, not rsqrt, as the reference
    spells it), times the weight itself (no 1 + w), cast back to x's dtype. ``weight`` None: the scale-less norm."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


def axial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """transformers' ``apply_multidimensional_rope`` with 2 axes on x [N, H, D]; cos/sin [N, 1, D] laid out as
    (x-axis angles twice, y-axis angles twice): each half of the head is rotate-half rotary over its own axis."""
    # (a, b): the halves of the x-axis half, (c, d): those of the y-axis half
    a, b, c, d = x.unflatten(-1, (4, -1)).unbind(-2)
    rotated = torch.cat((-b, a, -d, c), dim=-1)
    return x * cos + rotated * sin


def vit_qk_norm_rope(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """q or k [N, H, D]: the per-head RMSNorm, then the axial rotary."""
    return axial_rope(vit_rms_norm(x, weight, eps), cos, sin)


def vit_gelu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.gelu(gate, approximate="tanh") * up


def vit_add_post_norm(residual: Tensor, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``residual + vit_rms_norm(x)``: a sublayer's post-norm and the residual add."""
    return residual + vit_rms_norm(x, weight, eps)


# The clip bounds' names and transformers' initial values (no clipping); a checkpoint's replace them.
CLIP_DEFAULTS = {
    "input_min": -float("inf"),
    "input_max": float("inf"),
    "output_min": -float("inf"),
    "output_max": float("inf"),
}


class RMSNorm(nn.Module):
    """Gemma 4's RMSNorm with its scale (the scale-less ones, v's and the embedder's, hold nothing: they are
    ``vit_rms_norm(x, None, eps)`` calls where they are used)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return vit_rms_norm(x, self.weight, self.eps)


class ClippableLinear(nn.Module):
    """A bias-free linear (``.linear``, the checkpoint's name) whose input and output are clamped to the checkpoint's
    scalar bounds (``input_min`` ... ``output_max`` buffers) when the config has ``use_clipped_linears``."""

    input_min: Tensor
    input_max: Tensor
    output_min: Tensor
    output_max: Tensor

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:  # transformers' init: no clipping until the checkpoint says otherwise
            for name, value in CLIP_DEFAULTS.items():
                self.register_buffer(name, torch.tensor(value))

    def forward(self, x: Tensor) -> Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


def fused_call(on: bool, fn: Callable[..., Tensor], x: Tensor, *args: Any) -> Tensor:
    """``fn(x, *args)``, compiled (fused.py) when the module's ``fused`` flag is on and the call is worth it.
    fused.compiled memoizes by ``__qualname__``: hence the ``vit_`` (and the LM's ``lm_``) names, apart from fused.py's
    own."""
    if on and fused.worth_it(x):
        out: Tensor = fused.compiled(fn)(x, *args)
        return out
    return fn(x, *args)


def attend(q: Tensor, k: Tensor, v: Tensor, seg: Segments, flash: bool) -> Tensor:
    """Bidirectional attention within each image (a segment of ``seg``), softmax scale 1. q [N, H, D], k and v
    [N, Hkv, D] (key/value heads repeated for grouped queries) -> [N, H, D]."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    found = varlen_attn()
    if flash and found is not None and varlen_takes_scale():
        out = found(q, k, v, seg.cu, seg.cu, seg.max_len, seg.max_len, scale=1.0)
        assert isinstance(out, Tensor)
        return out
    # SDPA, one call per distinct image length (equal-length images batched): on the CPU its math matches
    # transformers' to float32 rounding; on CUDA it takes FlashAttention / cuDNN / memory-efficient kernels.
    perm, inv, groups = seg.sdpa_groups
    qkv = (q, k, v) if perm is None else (q[perm], k[perm], v[perm])
    outs = []
    for start, count, length in groups:
        q_g, k_g, v_g = (
            t[start : start + count * length].unflatten(0, (count, length)).transpose(1, 2) for t in qkv
        )
        outs.append(F.scaled_dot_product_attention(q_g, k_g, v_g, scale=1.0).transpose(1, 2).flatten(0, 1))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out[inv] if inv is not None else out


class SelfAttention(nn.Module):
    def __init__(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, clipped: bool
    ) -> None:
        super().__init__()
        if heads % kv_heads:
            raise ValueError(
                f"vision num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.q_proj = ClippableLinear(hidden, heads * head_dim, clipped)
        self.k_proj = ClippableLinear(hidden, kv_heads * head_dim, clipped)
        self.v_proj = ClippableLinear(hidden, kv_heads * head_dim, clipped)
        self.o_proj = ClippableLinear(heads * head_dim, hidden, clipped)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.fused = False

    def forward(self, x: Tensor, seg: Segments, cos: Tensor, sin: Tensor, flash: bool) -> Tensor:
        """x [N, hidden]; cos/sin [N, 1, head_dim] in x's dtype."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        q = fused_call(self.fused, vit_qk_norm_rope, q, self.q_norm.weight, self.eps, cos, sin)
        k = fused_call(self.fused, vit_qk_norm_rope, k, self.k_norm.weight, self.eps, cos, sin)
        v = fused_call(self.fused, vit_rms_norm, v, None, self.eps)  # transformers' v_norm: no scale
        return self.o_proj(attend(q, k, v, seg, flash).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, clipped: bool) -> None:
        super().__init__()
        self.gate_proj = ClippableLinear(hidden, intermediate, clipped)
        self.up_proj = ClippableLinear(hidden, intermediate, clipped)
        self.down_proj = ClippableLinear(intermediate, hidden, clipped)
        self.act = activation(act)
        self.tanh_gelu = act == "gelu_pytorch_tanh"  # the one activation with a fused gate * up
        self.fused = False

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.tanh_gelu:
            return self.down_proj(fused_call(self.fused, vit_gelu_mul, gate, up))
        return self.down_proj(self.act(gate) * up)


class EncoderLayer(nn.Module):
    """Pre- and post-norm around both sublayers (transformers' Gemma4VisionEncoderLayer)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        act: str,
        eps: float,
        clipped: bool,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.self_attn = SelfAttention(hidden, heads, kv_heads, head_dim, eps, clipped)
        self.mlp = MLP(hidden, intermediate, act, clipped)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.fused = False

    def forward(self, x: Tensor, seg: Segments, cos: Tensor, sin: Tensor, flash: bool) -> Tensor:
        eps, on = self.eps, self.fused
        attn = self.self_attn(
            fused_call(on, vit_rms_norm, x, self.input_layernorm.weight, eps), seg, cos, sin, flash
        )
        x = fused_call(on, vit_add_post_norm, x, attn, self.post_attention_layernorm.weight, eps)
        mlp = self.mlp(fused_call(on, vit_rms_norm, x, self.pre_feedforward_layernorm.weight, eps))
        return fused_call(on, vit_add_post_norm, x, mlp, self.post_feedforward_layernorm.weight, eps)


def use_flash(x: Tensor, backend: str) -> bool:
    """Whether attention takes FlashAttention varlen: CUDA, half precision, a torch whose varlen takes a scale, and a
    backend other than "sdpa"."""
    return (
        backend != "sdpa"
        and x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and varlen_available()
        and varlen_takes_scale()
    )
