"""The block-FP8 recipe's activation quantization as one Triton kernel: x [M, K] -> e4m3 per 1 x 128 group of each
row, with the scales in the token-major layout cuBLAS's block-scaled GEMM takes ([M, K / 128], stride (1, M)).

Why a kernel of our own: fp8_quant.quantize_token_groups is six or seven torch ops with float32 copies between
them. fp8_gemm.py ran the torch.compile'd version from 32 rows, but only outside CUDA graphs (nothing may compile in
a capture), so the piecewise graphs' steps (prefill chunks and mixed steps up to 1,024 tokens) captured the eager
ops: fp8_gemm_bench's graph-replayed block GEMMs at 2,048 rows, that quantization included, took 1.5-2x bf16's time
on the Qwen3-VL-8B shape's qkv, o and down projections (H200, 2026-12-02). This kernel reads x once and writes the
values and their scales; neither the row count nor K is specialised on, so every step, captured or not, runs the
variant the block GEMMs' start-up probe compiled for the activations' dtype.

Bits: fp8_quant's (the group's absolute max over 448, at least 1e-12; x divided by it, rounded to nearest as torch
divides, clamped to +-448, rounded to e4m3).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels import w8a16_gemm
from workers.engine.kernels.fp8_quant import BLOCK, FP8, quantize_token_groups
from workers.engine.kernels.triton_switch import TritonSwitch

GROUPS = 8  # 128-column groups per program: 2 KB of a bf16 row

SWITCH = TritonSwitch("GLIMPSE_TRITON_FP8_QUANT")
available = SWITCH.on  # on CUDA tensors, or anywhere under TRITON_INTERPRET=1


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["rows", "groups"])  # a row's start stays 128-aligned: GROUP is a constant
    def group_quant_kernel(x_ptr, q_ptr, s_ptr, rows, groups, GROUP: tl.constexpr, GROUPS: tl.constexpr):
        row = tl.program_id(0)
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        g_ok = g < groups
        cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        at = row.to(tl.int64) * groups * GROUP + cols
        x = tl.load(x_ptr + at, mask=g_ok[:, None], other=0.0).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0), 1e-12)  # fp8_quant's FP8_MAX, _MIN_SCALE
        q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0)
        tl.store(q_ptr + at, q.to(q_ptr.dtype.element_ty), mask=g_ok[:, None])
        tl.store(s_ptr + g.to(tl.int64) * rows + row, scale, mask=g_ok)  # token-major: scale [g, row]

    return group_quant_kernel


def torch_ops(x: Tensor) -> tuple[Tensor, Tensor]:
    """``quantize``'s result from fp8_quant's torch ops (where the kernel is off): the scales token-major."""
    q, scale = quantize_token_groups(x)
    return q, scale.t().contiguous().t()


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] (K a multiple of 128, bf16/fp16/fp32) -> (e4m3 [M, K], float32 scales [M, K / 128] with stride
    (1, M)): fp8_gemm.fp8_block_activations' result, in one kernel."""
    rows, k = x.shape
    if k % BLOCK:
        raise ValueError(f"group quantization takes whole {BLOCK}-column groups, not K = {k}")
    groups = k // BLOCK
    x = x.contiguous()
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = torch.empty((groups, rows), dtype=torch.float32, device=x.device)
    if rows:
        _kernel()[(rows, -(-groups // GROUPS))](x, q, scale, rows, groups, GROUP=BLOCK, GROUPS=GROUPS)
    return q, scale.t()


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once against fp8_quant's ops (the same bits); a Triton that cannot compile here or another
    answer turns it off for the process (the torch ops serve) rather than failing mid-serving."""
    # Values that divide into e4m3 exactly (Triton's interpreter rounds to e4m3 otherwise than the GPU), groups 2^-3
    # to 2^6 (kept exact in float16), a zero group (the floor scale, zeros out) and a partial last program (10 groups).
    x = w8a16_gemm.exact_rows(3, 10 * BLOCK, torch.Generator().manual_seed(0))
    x = x * torch.exp2(torch.arange(-3, 7).float()).repeat_interleave(BLOCK)
    x[1, :BLOCK] = 0
    x = x.to(device=device, dtype=dtype)

    def check() -> bool:
        q, s = quantize(x)
        want_q, want_s = quantize_token_groups(x)
        return s.stride() == (1, 3) and torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))

    return SWITCH.probe(check)
