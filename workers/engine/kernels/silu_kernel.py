"""SiLU(gate) * up in one Triton kernel, for the MLPs' fused path on CUDA.

The MLPs' gate|up GEMM writes [T, 2I]; the activation reads both halves and writes [T, I]. That pass is pure
memory traffic, so its floor is the card's bandwidth: 21.6k LM tokens of a 7B (I = 18,944, 28 layers) move
69 GB, ~21 ms on an H100. The torch.compile'd version (fused.silu_mul) reaches that at the LM's width, but at the
ViT's (3,424) it streamed at about half (H100: 1.56 TB/s against this kernel's 2.87 TB/s; docs/benchmarks.md,
session 11, `python -m benchmarks.kernels.silu_bench`). Here each program streams a contiguous run of one row's columns
with wide loads; the math is float32 and rounds once, as the compiled version does.

The grid is (rows, column blocks) and the row count is not an argument, so a new token count never compiles a new
variant (nothing may compile inside a CUDA-graph capture); the width is a compile-time constant per model.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels import pdl
from workers.engine.kernels.triton_switch import TritonSwitch

BLOCK = 1024  # columns per program: 2 KB of bf16 per half

SWITCH = TritonSwitch("GLIMPSE_TRITON_SILU")
available = SWITCH.on  # the kernel runs on CUDA tensors, or anywhere under TRITON_INTERPRET=1


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, row_stride, WIDTH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # pdl.py: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < WIDTH
        src = x_ptr + row * row_stride + cols
        gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + WIDTH, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * WIDTH + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    return silu_mul_kernel


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once against eager math; a Triton that cannot compile here or a wrong answer turns it off
    for the process (the compiled version serves instead) rather than failing mid-serving."""
    x = torch.randn(3, 2 * 1000, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)

    def check() -> bool:
        gate, up = x.float().chunk(2, dim=-1)
        return torch.allclose(silu_mul(x).float(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)

    return SWITCH.probe(check)


def silu_mul(gate_up: Tensor) -> Tensor:
    """[T, 2I] -> silu(gate) * up [T, I], in ``gate_up``'s dtype. Rows may be strided (a column block of a wider
    projection's output, as Qwen3.5-MoE's joined router and shared-expert matmul gives); each row's 2I values must be
    contiguous."""
    rows, double = gate_up.shape
    width = double // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        if gate_up.stride(-1) != 1:
            gate_up = gate_up.contiguous()
        _kernel()[(rows, -(-width // BLOCK))](
            gate_up, out, gate_up.stride(0), WIDTH=width, BLOCK=BLOCK, num_warps=4, **pdl.launch(out.device)
        )
    return out
