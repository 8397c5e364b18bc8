"""The routed experts of a decode batch in Triton: one program per (expert, block of output columns).

moe_kernel.py's kernels give each token-expert pair its own programs, which read the pair's expert once per token
that chose it: right for a handful of rows, where few pairs share an expert. Under load a decode step carries 17 to a
few hundred rows, and at 64 rows x top 8 over 128 experts each expert serves ~4 pairs: read once per pair, the
weights stream four times over. The grouped-GEMM path (qwen3_vl/moe.py ``experts_grouped``) reads each expert once,
but around its two ``torch._grouped_mm`` calls it sorts, gathers, applies the activation, weights, scatters and sums
in a dozen kernels a layer.

Here each program owns one expert and one block of output columns. It finds its expert's pairs itself: it scans the
layer's [T * k] expert ids in blocks, ranks the matches with a cumulative sum and picks the ranks it is serving, so
there is no sort, no gather pass and no offsets tensor; an expert no pair chose reads no weights. Its rows' inputs
are gathered straight from x (or from the activations), multiplied on the tensor cores against the weight block,
read once for up to ``BLOCK_M`` pairs, and written per pair:

* ``up``: act(x W_gate^T) * (x W_up^T) for the pair (SiLU, or tanh-GELU for Gemma 4), into h [T * k, I];
* ``down``: (h W_down^T) times the pair's routing weight, into a float32 partial [T * k, H], which moe_kernel.py's
  ``sum_pairs`` sums per token in a fixed order (deterministic, no atomics).

Rows are never a constexpr (the pair count is an argument Triton does not specialise on), so a layer's kernels
compile once per weight shape, at the warm-up's forwards, never inside a CUDA-graph capture. bf16/fp16/float32 stacks
(float32 multiplies in IEEE precision, not TF32, so CUDA float32 checks see float32 math), and FP8 stacks with their
scales, the weights widened in registers (per-row scales applied to each output column once, block scales to each
block of the reduction's product).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels.fp8_quant import FP8
from workers.engine.kernels.triton_switch import TritonSwitch

# Up to how many token rows these kernels serve a layer (above: the grouped GEMMs, whose tiles fill at prefill sizes).
# Per layer, 20 layers replayed from a graph, randomly routed (`python -m benchmarks.kernels.moe_bench`, H200), these
# kernels against the grouped GEMMs at 64 / 128 / 256 rows: Qwen3-VL-30B-A3B 323.9 / 363.8 / 607.4 against 506.4 /
# 517.5 / 534.0 us, Qwen3.6-35B-A3B 375.3 / 475.4 / 650.2 against 584.1 / 636.1 / 660.6, Gemma 4 26B-A4B 413.7 / 463.6
# / 772.4 against 633.6 / 650.5 / 670.5: past ~200 rows an expert's pairs need several passes over its weights.
MAX_ROWS = 128
# Tiles: pairs a weight block serves per pass, output columns and reduction columns per program; the id scan's block.
# Of nine tile sets (`moe_bench --batched-sweep --rows 32,64,128`, H200) the best at each row count was within 2-5% of
# these on the 30B-A3B's and 35B-A3B's experts, and none was best at all three.
BLOCK_M = 16
UP_BLOCK_N, UP_BLOCK_K = 64, 64
DOWN_BLOCK_N, DOWN_BLOCK_K = 64, 64
NUM_WARPS, NUM_STAGES = 4, 3
BLOCK_P = 128

SWITCH = TritonSwitch("GLIMPSE_TRITON_MOE_BATCHED")
available = SWITCH.on
# FP8 stacks through the same kernels (per-row, per row and 128 columns, or 128 x 128 tile scales), probed apart.
# Opt-in (GLIMPSE_TRITON_MOE_BATCHED_FP8=1) until timed on a GPU against the grouped FP8 GEMMs they would replace
# (`python -m benchmarks.kernels.moe_bench --fp8`); checked against the dequantized experts under Triton's interpreter.
FP8_SWITCH = TritonSwitch("GLIMPSE_TRITON_MOE_BATCHED_FP8")


def fp8_on() -> bool:
    return os.environ.get(FP8_SWITCH.env) == "1" and FP8_SWITCH.on()


@functools.cache
def _kernels() -> tuple[Any, Any]:
    from workers.engine.kernels import moe_batched_jit

    return moe_batched_jit.up_kernel, moe_batched_jit.down_kernel


def wanted(x: Tensor, gate_up: Tensor) -> bool:
    """Whether these kernels should run a MoE layer's experts for x [T, H]: a decode batch's rows, weights in x's
    dtype or FP8 (with its scales; ``FP8_SWITCH``), the kernels on."""
    return (
        0 < x.shape[0] <= MAX_ROWS
        and (gate_up.dtype == x.dtype or (gate_up.dtype == FP8 and fp8_on()))
        and x.is_cuda
        and available()
    )


# (block scales?, the scale tensor's rows, weight rows per scale row): moe_kernel._scale_layout's answer.
Layout = tuple[bool, int, int]
NO_SCALES: Layout = (False, 1, 1)


def up(x: Tensor, ids: Tensor, gate_up: Tensor, gelu: bool = False, scale: Tensor | None = None,
       layout: Layout = NO_SCALES) -> Tensor:  # fmt: skip
    """h [T * k, I]: act(gate[e] x_t) * up[e] x_t for every pair (t, j), e = ids[t, j]; x [T, H], ids [T, k],
    ``gate_up`` [E, 2I, H] (each expert's gate rows, then its up rows), FP8 with its float32 ``scale`` laid out as
    ``layout`` says."""
    rows, hidden = x.shape
    top_k = ids.shape[1]
    experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    h = torch.empty((rows * top_k, inter), dtype=x.dtype, device=x.device)
    if rows:
        _check_blocks(layout, UP_BLOCK_K)
        s_ptr = h if scale is None else scale.float().contiguous()  # (a pointer the kernel never reads without FP8)
        _kernels()[0][(experts, -(-inter // UP_BLOCK_N))](
            x.contiguous(), ids.contiguous(), gate_up.contiguous(), s_ptr, h, rows * top_k, H=hidden, INTER=inter, K=top_k, GELU=gelu, IEEE=x.dtype == torch.float32,
            FP8=gate_up.dtype == FP8, BLOCKS=layout[0], SCALE_ROWS=layout[1], ROWS_PER_SCALE=layout[2],
            BLOCK_M=BLOCK_M, BLOCK_N=UP_BLOCK_N, BLOCK_K=UP_BLOCK_K, BLOCK_P=BLOCK_P, NUM_STAGES=NUM_STAGES,
            num_warps=NUM_WARPS)
    return h


def down(h: Tensor, ids: Tensor, weights: Tensor, down_stack: Tensor, scale: Tensor | None = None,
         layout: Layout = NO_SCALES) -> Tensor:  # fmt: skip
    """float32 partials [T * k, H]: weights[t, j] * down[e] h_(t, j) for every pair; ``down_stack`` [E, H, I],
    FP8 with its ``scale`` as in ``up``."""
    pairs, inter = h.shape
    experts, hidden = down_stack.shape[0], down_stack.shape[1]
    part = torch.empty((pairs, hidden), dtype=torch.float32, device=h.device)
    if pairs:
        _check_blocks(layout, DOWN_BLOCK_K)
        s_ptr = part if scale is None else scale.float().contiguous()
        _kernels()[1][(experts, -(-hidden // DOWN_BLOCK_N))](
            h, ids.contiguous(), weights.contiguous(), down_stack.contiguous(), s_ptr, part, pairs, H=hidden, INTER=inter, IEEE=h.dtype == torch.float32, FP8=down_stack.dtype == FP8,
            BLOCKS=layout[0], SCALE_ROWS=layout[1], ROWS_PER_SCALE=layout[2], BLOCK_M=BLOCK_M,
            BLOCK_N=DOWN_BLOCK_N, BLOCK_K=DOWN_BLOCK_K, BLOCK_P=BLOCK_P, NUM_STAGES=NUM_STAGES,
            num_warps=NUM_WARPS)
    return part


def _check_blocks(layout: Layout, block_k: int) -> None:
    if layout[0] and 128 % block_k:  # a reduction block must fall in one 128-column scale block
        raise ValueError(f"block scales need a reduction block that divides 128, not {block_k}")
