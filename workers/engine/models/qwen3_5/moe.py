"""Qwen3.5-MoE's sparse block: Qwen3-VL-MoE's router and routed experts (qwen3_vl/moe.py: same routing, the same
three checkpoint layouts of expert weights) plus a shared expert every token takes, scaled by a sigmoid gate.

transformers' ``Qwen3_5MoeSparseMoeBlock``: out = routed + sigmoid(x @ shared_expert_gate^T) * shared(x). Under
tensor parallelism the shared expert is split like a dense MLP; its row-parallel down projection does not reduce on
its own, so the routed and shared partial sums share the block's one all-reduce (the sigmoid gate, replicated,
scales every rank's partial alike).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.kernels.skinny_gemm import settled
from workers.engine.layers.linear import SINGLE_RANK, TPGroup
from workers.engine.models.decoder_layers import SwiGLUMLP
from workers.engine.models.qwen3_vl.moe import (
    SparseMoeBlock,
)

# Rows of the joined projection (``SharedExpertMoeBlock.join``) are a multiple of this: cuBLAS's aligned kernels.
JOIN_ALIGN = 8

# Checkpoint projection -> (fused parameter part, shard id) of the shared expert's gate_up_proj.
SHARED_EXPERT_PARTS: tuple[tuple[str, str, int], ...] = (
    (".shared_expert.gate_proj.", ".shared_expert.gate_up_proj.", 0),
    (".shared_expert.up_proj.", ".shared_expert.gate_up_proj.", 1),
)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Router (``gate``) and routed ``experts`` as in Qwen3-VL-MoE, plus ``shared_expert`` and its
    ``shared_expert_gate`` (one logit per token, replicated)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_intermediate_size: int,
        tp: TPGroup = SINGLE_RANK,
    ) -> None:
        super().__init__(hidden_size, num_experts, top_k, intermediate_size, tp)
        self.shared_expert = SwiGLUMLP(hidden_size, shared_intermediate_size, tp)
        self.shared_expert.down_proj.reduce_output = False  # reduced with the routed experts' partial sum
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.shared_expert_gate.weight.requires_grad_(False)
        # CUDA (the fused flag): the shared expert's gate_up, the router and the shared gate as one matrix (``join``).
        self._joined: Tensor | None = None
        self._joined_pad = 0  # zero rows at the joined matrix's end
        self._join_tried = False

    def join(self) -> bool:
        """Lay the shared expert's gate_up rows, the router's and the shared gate's out as one matrix and make the
        three parameters views of its row blocks (no second copy), so a step's three projections of x are one GEMM.
        At batch 1 on an H200 the three were four kernels (the one-row gate alone took cuBLAS's gemv and dot);
        the joined one is a single GEMV over the same bytes. Once, on the first fused forward (warm-up, before any
        graph capture); not where a weight is FP8 or the dtypes differ."""
        if not self._join_tried:
            self._join_tried = True
            up = self.shared_expert.gate_up_proj
            parts = [up.weight, self.gate.weight, self.shared_expert_gate.weight]
            if up.weight_scale is None and up.bias is None and len({(p.dtype, p.device) for p in parts}) == 1:
                # Zero rows to a multiple of 8: with the shared gate's one row the width is odd (35B-A3B: 1,281),
                # and cuBLAS then takes an unaligned sm75 kernel for prefill rows (2.7 ms of a 2,048-token step's
                # 32 ms on an H200, 20 layers).
                pad = parts[0].new_zeros(-sum(p.shape[0] for p in parts) % JOIN_ALIGN, parts[0].shape[1])
                joined = torch.cat([*(p.data for p in parts), pad])
                self._joined_pad = pad.shape[0]
                row = 0
                for p in parts:
                    p.data = joined[row : row + p.shape[0]]
                    row += p.shape[0]
                self._joined = joined
        return self._joined is not None

    def forward(self, x: Tensor) -> Tensor:
        if self.fused and self.join():
            assert self._joined is not None
            experts = self.gate.weight.shape[0]
            gate_up, logits, shared_logit, _ = F.linear(x, self._joined).split(
                [self.shared_expert.gate_up_proj.weight.shape[0], experts, 1, self._joined_pad], dim=-1
            )
            shared = torch.sigmoid(shared_logit) * settled(self.shared_expert.from_gate_up(gate_up))
            return self.tp.all_reduce(self.routed(x, logits) + shared)
        shared = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * settled(self.shared_expert(x))
        return self.tp.all_reduce(self.routed(x) + shared)
