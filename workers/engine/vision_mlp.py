"""The vision tower's SwiGLU MLP, with a GPU layout that keeps cuBLAS on its Hopper kernels.

Qwen2.5-VL's vision MLP width is 3420: a bf16 row of 3420 is 6840 bytes, not a multiple of 16, and
cuBLAS's Hopper GEMMs need 16-byte-aligned rows. gate_proj and up_proj (output rows of 3420) and
down_proj (input rows of 3420) then ran on an sm80 fallback kernel: 0.43 ms each per block for one
1080p image, ~220 TFLOP/s, a third of the card (H200, measured). ``pack`` fixes the layout on CUDA:
gate and up become one [2I, H] GEMM (rows of 2I = 6840 are aligned), and down_proj's input width is
padded with zero columns to a multiple of 8. The padding adds exact zeros to every dot product, so it
changes nothing but which kernel runs (and with it bf16 rounding order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine import fused


class VisionMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)
        self.act = act
        self.packed: tuple[Tensor, Tensor, Tensor] | None = None  # gate_up weight, its bias, padded down weight
        self.fused = False  # CUDA, packed, SiLU: activation, product and padding in one kernel (fused.py)

    @torch.no_grad()
    def pack(self) -> None:
        """Move the weights into the GPU layout (after loading). The nn.Linear parameters become views
        of the packed storage, so names and shapes stay those of the checkpoint and nothing is held twice."""
        inter, hidden = self.gate_proj.weight.shape
        width = -(-inter // 8) * 8
        gate_up = torch.cat((self.gate_proj.weight, self.up_proj.weight))
        bias = torch.cat((self.gate_proj.bias, self.up_proj.bias))
        down = gate_up.new_zeros(hidden, width)
        down[:, :inter] = self.down_proj.weight
        for linear, weight, b in (
            (self.gate_proj, gate_up[:inter], bias[:inter]),
            (self.up_proj, gate_up[inter:], bias[inter:]),
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
        inter = self.gate_proj.weight.shape[0]
        if self.fused and x.is_cuda and self.act is F.silu:
            h = fused.compiled(fused.silu_mul)(F.linear(x, gate_up, bias), down.shape[1] - inter)
            return F.linear(h, down, self.down_proj.bias)
        gate, up = F.linear(x, gate_up, bias).split(inter, dim=-1)
        h = x.new_empty(x.shape[0], down.shape[1])
        h[:, inter:].zero_()  # the padding columns meet zero weights, but 0 * NaN garbage would not be 0
        torch.mul(self.act(gate), up, out=h[:, :inter])
        return F.linear(h, down, self.down_proj.bias)
