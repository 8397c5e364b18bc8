"""Gemma 4's routed experts (26B-A4B): they run beside each layer's dense MLP, routed by their own router.

transformers' ``Gemma4TextRouter``: the residual stream (not the MLP's normed input) is RMS-normalised without a
scale, multiplied by a learned ``scale`` and by hidden_size**-0.5, projected to expert logits; softmax in float32,
top-k, the k weights renormalised to sum to 1, then multiplied by the chosen experts' ``per_expert_scale``. The
weights stay float32 (transformers never casts them back): each expert's output is scaled in float32 and cast to the
model dtype when it is index-added, as ``Gemma4TextExperts`` does.

The experts are Qwen3-VL-MoE's stacked layout (qwen3_vl/moe.py's StackedExperts: ``gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I], the Hub's own layout for Gemma 4, each expert's intermediate dim split over TP ranks) with a
GELU (tanh) gate instead of SiLU. The block returns this rank's partial sum; the layer all-reduces it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.kernels import moe_kernel
from workers.engine.layers.linear import SINGLE_RANK, TPGroup
from workers.engine.models.gemma4.lm_layers import GemmaRMSNorm, lm_router_input
from workers.engine.models.gemma4.vision_layers import fused_call
from workers.engine.models.qwen3_vl.moe import StackedExperts, experts_grouped, grouped_mm_usable

# Whether a decode step runs the dense MLP on a side stream beside the routed experts (lm.py). At batch 1 neither
# fills an H200's bandwidth alone: the experts read 95 MB a layer at ~2.1 TB/s, the dense MLP 36 MB at ~2.2.
OVERLAP_DENSE_MLP = True


def beside_experts(h: Tensor, tp: TPGroup) -> bool:
    """Whether this layer's dense MLP should run beside its experts for h [T, H]: CUDA, a decode step's few rows
    (the Triton expert kernels' range), one rank (two all-reduces on two streams could interleave differently on
    different ranks and deadlock)."""
    return OVERLAP_DENSE_MLP and h.is_cuda and tp.size == 1 and 0 < h.shape[0] <= moe_kernel.MAX_ROWS


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class GemmaRouter(nn.Module):
    """Replicated on every rank (its input, the residual stream, is the same everywhere), so every rank picks the same
    experts. Parameter names are the checkpoint's: ``router.proj.weight``, ``router.scale``, ``router.per_expert_scale``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.scalar_root_size = hidden_size**-0.5
        self.norm = GemmaRMSNorm(hidden_size, eps, with_scale=False)
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.proj.weight.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)
        self.fused = False  # CUDA: the scale-less norm and both scalings as one compiled kernel

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """h [T, H] -> (float32 weights [T, k], expert ids int64 [T, k])."""
        x = fused_call(self.fused, lm_router_input, h, self.scale, self.scalar_root_size, self.norm.eps)
        if moe_kernel.wanted(x, self.proj.weight):  # a decode step's few rows: one kernel after the projection
            return moe_kernel.route(F.linear(x, self.proj.weight), self.top_k, self.per_expert_scale)
        probs = torch.softmax(F.linear(x, self.proj.weight), dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return top * self.per_expert_scale[ids], ids


def gelu_experts_loop(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """transformers' expert loop: for each expert that got tokens, in id order, gelu_tanh(gate) * up on those tokens,
    down-projected, scaled by their routing weight and index-added to the output. x [T, H], weights / ids [T, k]."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        g, u = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.gelu(g, approximate="tanh") * u, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


class GemmaExperts(StackedExperts):
    """This rank's slice of every expert (``experts.gate_up_proj`` / ``experts.down_proj``, as the checkpoint names
    them); forward returns the rank's partial sum of the routed outputs, not yet reduced. An FP8 checkpoint's stacks
    may be FP8 (models/fp8_layers.py: ``fp8_grouped``), as Qwen's are: the Triton kernels and the grouped FP8 GEMMs
    take them, anything else their dequantized copies."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, tp)

    def capturable(self) -> bool:
        """Whether a CUDA graph can hold this block's decode steps: the Triton kernels (up to moe_kernel.MAX_ROWS
        rows) and the grouped GEMMs (more rows) have no host sync; the loop has (which experts got tokens)."""
        one_row = self.gate_up_proj[0, :1]  # [1, H]: the stacks' device
        scales = self.fp8_scales()
        if scales is not None:  # FP8 stacks: asked for bf16 rows, the dtype FP8 layers serve
            return self.fp8_grouped_usable(one_row.to(torch.bfloat16), scales)
        return grouped_mm_usable(one_row, self.gate_up_proj, self.down_proj)

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        scales = self.fp8_scales()
        if moe_kernel.wanted(x, self.gate_up_proj):  # a decode step's few rows: no loop, no host sync
            return moe_kernel.experts(x, weights, ids, self.gate_up_proj, self.down_proj, gelu=True, scales=scales)
        if scales is not None and self.fp8_grouped_usable(x, scales):  # CUDA: two grouped FP8 GEMMs
            return experts_grouped(x, weights, ids, self.gate_up_proj, self.down_proj, fp8_scales=scales,
                                   gelu=True).to(x.dtype)
        gate_up, down = self.bf16_weights(x.dtype)
        if grouped_mm_usable(x, gate_up, down):  # CUDA bf16: two grouped GEMMs, no host sync
            return experts_grouped(x, weights, ids, gate_up, down, gelu=True).to(x.dtype)
        return gelu_experts_loop(x, weights, ids, gate_up, down)
