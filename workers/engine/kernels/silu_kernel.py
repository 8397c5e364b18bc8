"""SiLU(gate) * up in one Triton kernel, for the MLPs' fused path on CUDA.

The MLPs' gate|up GEMM writes [T, 2I]; the activation reads both halves and writes [T, I]. That pass is pure
memory traffic, so its floor is the card's bandwidth: 21.6k LM tokens of a 7B (I = 18,944, 28 layers) move
69 GB, ~21 ms on an H100. The torch.compile'd version (fused.silu_mul) reaches that at the LM's width, but at the
ViT's (3,424) it streamed at about half (H100: 1.56 TB/s against this kernel's 2.87 TB/s; docs/benchmarks.md,
session 11, `python -m benchmarks.kernels.silu_bench`). Here each program streams a contiguous run of one row's columns
with wide loads; the math is float32 and rounds once, as the compiled version does.

A split-K gate_up (block-FP8's decode GEMM splits Qwen3-VL-8B's in 2) comes as float32 partials: the kernel sums them
in split order with the bias and rounds the sum as the sum pass does, so the bits are the same and the pass's kernel is
saved.

The grid is (rows, column blocks) and the row count is not an argument, so a new token count never compiles a new
variant (nothing may compile inside a CUDA-graph capture); the width is a compile-time constant per model.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels import pdl
from workers.engine.kernels.skinny_gemm import Partials
from workers.engine.kernels.triton_switch import TritonSwitch

BLOCK = 1024  # columns per program: 2 KB of bf16 per half

SWITCH = TritonSwitch("GLIMPSE_TRITON_SILU")
available = SWITCH.on  # the kernel runs on CUDA tensors, or anywhere under TRITON_INTERPRET=1


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["plane"])
    def silu_mul_kernel(
        x_ptr, b_ptr, out_ptr, row_stride, plane, WIDTH: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # pdl.py: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < WIDTH
        src = x_ptr + row * row_stride + cols
        dtype = out_ptr.dtype.element_ty
        if SPLIT == 0:
            gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(src + WIDTH, mask=mask, other=0.0).to(tl.float32)
        else:
            # float32 split-K partials [SPLIT, rows, 2 * WIDTH]: summed from zero in split order, the bias added and
            # the sum rounded to the activations' dtype, bit for bit the sum pass's (skinny_gemm.sum_splits)
            gate = tl.zeros((BLOCK,), dtype=tl.float32)
            up = tl.zeros((BLOCK,), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                gate += tl.load(src + s * plane, mask=mask, other=0.0)
                up += tl.load(src + s * plane + WIDTH, mask=mask, other=0.0)
            if HAS_BIAS:
                gate += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                up += tl.load(b_ptr + WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
            gate = gate.to(dtype).to(tl.float32)
            up = up.to(dtype).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * WIDTH + cols, out.to(dtype), mask=mask)

    return silu_mul_kernel


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once against eager math; a Triton that cannot compile here or a wrong answer turns it off
    for the process (the compiled version serves instead) rather than failing mid-serving."""
    x = torch.randn(3, 2 * 1000, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)

    def check() -> bool:
        gate, up = x.float().chunk(2, dim=-1)
        return torch.allclose(silu_mul(x).float(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)

    return SWITCH.probe(check)


def silu_mul(gate_up: Tensor | Partials) -> Tensor:
    """[T, 2I] -> silu(gate) * up [T, I], in ``gate_up``'s dtype. Rows may be strided (a column block of a wider
    projection's output, as Qwen3.5-MoE's joined router and shared-expert matmul gives); each row's 2I values must be
    contiguous. A split-K decode product's partials (skinny_gemm.Partials) are summed here, the sum pass's kernel
    saved: FP8's gate_up splits K in 2 at decode rows (w8a16_gemm.py)."""
    if isinstance(gate_up, Partials):
        split, rows, double = gate_up.parts.shape
        src, dtype, stride = gate_up.parts, gate_up.dtype, double
        bias = gate_up.bias
    else:
        rows, double = gate_up.shape
        if gate_up.stride(-1) != 1:
            gate_up = gate_up.contiguous()
        split, src, dtype, stride, bias = 0, gate_up, gate_up.dtype, gate_up.stride(0), None
    width = double // 2
    out = torch.empty((rows, width), dtype=dtype, device=src.device)
    if rows:
        _kernel()[(rows, -(-width // BLOCK))](
            src, bias if bias is not None else src, out, stride, rows * double, WIDTH=width, BLOCK=BLOCK, SPLIT=split,
            HAS_BIAS=bias is not None, num_warps=4, **pdl.launch(out.device),
        )  # fmt: skip
    return out
