"""Gemma 4's vision encoder layer on CUDA as two compiled pieces around its attention.

Per layer the eager tower dispatches about 30 kernels from Python: seven projections, each with two clamps where the
checkpoint has ``use_clipped_linears`` (the published ones do), four norms, the q/k norm-and-rotary, the v norm, the
GELU gate and two residual post-norms. At one 1080p image (2,268 patches at the default budget) the GPU needs a few
milliseconds for a layer's work, so the tower's time was the host's: 37-65 ms per image in a side-by-side run's step
trace (H200, 27 layers). Here everything before attention (input norm, clamped q/k/v, their norms and rotary) is one
compiled function and everything after it (clamped o projection, post-norm and residual, the MLP with its clamps and
the second post-norm) another: Inductor keeps the GEMMs in cuBLAS and folds every clamp, norm and activation into the
kernels beside them, so a layer is three host calls (piece, attention, piece) and its weights are arguments (one
graph serves all layers).

The eager layers (vision_layers.py) stay the reference and the CPU path; these compute the same ops in the same
order, compiled (fused.py's rules: one rounding per fused kernel in half precision).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.engine.kernels import fused
from workers.engine.layers.vision_attention import Segments
from workers.engine.models.gemma4.vision_layers import (
    ClippableLinear,
    EncoderLayer,
    attend,
    vit_add_post_norm,
    vit_qk_norm_rope,
    vit_rms_norm,
)
from workers.engine.models.qwen_vit import activation

# A projection's tensors: (weight,) or, clipped, (weight, input_min, input_max, output_min, output_max).
Proj = tuple[Tensor, ...]


def proj_args(p: ClippableLinear) -> Proj:
    if not p.clipped:
        return (p.linear.weight,)
    return (p.linear.weight, p.input_min, p.input_max, p.output_min, p.output_max)


def _project(x: Tensor, p: Proj) -> Tensor:
    """ClippableLinear.forward on its tensors."""
    if len(p) == 1:
        return F.linear(x, p[0])
    weight, in_min, in_max, out_min, out_max = p
    return torch.clamp(F.linear(torch.clamp(x, in_min, in_max), weight), out_min, out_max)


def vit_layer_attn_in(
    x: Tensor,
    norm: Tensor,
    q: Proj,
    k: Proj,
    v: Proj,
    q_norm: Tensor,
    k_norm: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float,
    shape: tuple[int, int, int],
) -> tuple[Tensor, Tensor, Tensor]:
    """The input norm, then SelfAttention.forward up to attention: q [N, H, D], k and v [N, Hkv, D].
    ``shape``: (heads, kv_heads, head_dim)."""
    heads, kv_heads, head_dim = shape
    n = x.shape[0]
    h = vit_rms_norm(x, norm, eps)
    q_out = vit_qk_norm_rope(_project(h, q).view(n, heads, head_dim), q_norm, eps, cos, sin)
    k_out = vit_qk_norm_rope(_project(h, k).view(n, kv_heads, head_dim), k_norm, eps, cos, sin)
    v_out = vit_rms_norm(_project(h, v).view(n, kv_heads, head_dim), None, eps)
    return q_out, k_out, v_out


def vit_layer_attn_out(
    x: Tensor,
    attn: Tensor,
    o: Proj,
    post_attn: Tensor,
    pre_ff: Tensor,
    gate: Proj,
    up: Proj,
    down: Proj,
    post_ff: Tensor,
    eps: float,
    act: str,
) -> Tensor:
    """From the attention's output [N, H * D] to the layer's: the o projection, the post-norm and residual, the MLP
    and its post-norm and residual (EncoderLayer.forward and MLP.forward)."""
    x = vit_add_post_norm(x, _project(attn, o), post_attn, eps)
    h = vit_rms_norm(x, pre_ff, eps)
    mlp = _project(activation(act)(_project(h, gate)) * _project(h, up), down)
    return vit_add_post_norm(x, mlp, post_ff, eps)


def fused_layer(
    layer: EncoderLayer, x: Tensor, seg: Segments, cos: Tensor, sin: Tensor, flash: bool, act: str
) -> Tensor:
    """``layer(x, seg, cos, sin, flash)`` in two compiled pieces around the attention call."""
    attn, mlp, eps = layer.self_attn, layer.mlp, layer.eps
    q, k, v = fused.compiled(vit_layer_attn_in)(
        x, layer.input_layernorm.weight, proj_args(attn.q_proj), proj_args(attn.k_proj), proj_args(attn.v_proj),
        attn.q_norm.weight, attn.k_norm.weight, cos, sin, eps, (attn.heads, attn.kv_heads, attn.head_dim),
    )
    out = attend(q, k, v, seg, flash).reshape(x.shape[0], -1)
    return cast(Tensor, fused.compiled(vit_layer_attn_out)(
        x, out, proj_args(attn.o_proj), layer.post_attention_layernorm.weight, layer.pre_feedforward_layernorm.weight,
        proj_args(mlp.gate_proj), proj_args(mlp.up_proj), proj_args(mlp.down_proj),
        layer.post_feedforward_layernorm.weight, eps, act,
    ))
