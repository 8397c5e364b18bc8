"""The vision tower's SwiGLU MLP, with a GPU layout that keeps cuBLAS on its Hopper kernels.

Qwen2.5-VL's vision MLP width is 3420: a bf16 row of 3420 is 6840 bytes, not a multiple of 16, and
cuBLAS's Hopper GEMMs need 16-byte-aligned rows. gate_proj and up_proj (output rows of 3420) and
down_proj (input rows of 3420) then ran on an sm80 fallback kernel: 0.43 ms each per block for one
1080p image, ~220 TFLOP/s, a third of the card (H200, measured). ``pack`` fixes the layout on CUDA:
gate and up become one GEMM whose halves are each padded with zero rows to a multiple of 8 (3424), and
down_proj's input is padded with zero columns to match. The padded columns of gate|up come out exactly 0
(0 * x + 0), silu(0) * 0 = 0 meets down's zero columns, so the padding changes nothing but which kernels
run; and every half starts 16-byte aligned, so the SiLU*up pass reads with vector loads (with halves of
3420 it ran at a third of the memory bandwidth).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.kernels import fused


class VisionMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)
        self.act = act
        self.packed: tuple[Tensor, Tensor, Tensor] | None = None  # gate_up weight, its bias, padded down weight
        self.fused = False  # CUDA, packed, SiLU: activation and product in one kernel (fused.py)

    @torch.no_grad()
    def pack(self) -> None:
        """Move the weights into the GPU layout (after loading). The nn.Linear parameters become views
        of the packed storage, so names and shapes stay those of the checkpoint and nothing is held twice."""
        inter, hidden = self.gate_proj.weight.shape
        width = -(-inter // 8) * 8
        gate_up = self.gate_proj.weight.new_zeros(2 * width, hidden)
        bias = self.gate_proj.bias.new_zeros(2 * width)
        down = gate_up.new_zeros(hidden, width)
        for rows, linear in ((slice(0, inter), self.gate_proj), (slice(width, width + inter), self.up_proj)):
            gate_up[rows] = linear.weight
            bias[rows] = linear.bias
        down[:, :inter] = self.down_proj.weight
        for linear, weight, b in (
            (self.gate_proj, gate_up[:inter], bias[:inter]),
            (self.up_proj, gate_up[width : width + inter], bias[width : width + inter]),
            (self.down_proj, down[:, :inter], None),
        ):
            linear.weight = nn.Parameter(weight, requires_grad=False)
            if b is not None:
                linear.bias = nn.Parameter(b, requires_grad=False)
        self.packed = (gate_up, bias, down)

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate_up, bias, down = self.packed
        if self.fused and self.act is F.silu and fused.worth_it(x):
            h = fused.fast_silu_mul(F.linear(x, gate_up, bias))
        else:
            gate, up = F.linear(x, gate_up, bias).chunk(2, dim=-1)
            h = self.act(gate) * up
        return F.linear(h, down, self.down_proj.bias)
