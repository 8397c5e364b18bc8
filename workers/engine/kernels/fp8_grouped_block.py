"""The routed experts of a 128 x 128 block-FP8 checkpoint at prefill rows: one Triton grouped GEMM on FP8 tensor
cores, with the checkpoint's block scales.

Why a kernel of our own: torch's grouped FP8 GEMM (``torch._scaled_grouped_mm``) has only the row-wise recipe on
Hopper, one scale per weight row over the whole K. Qwen's ``-FP8`` MoE checkpoints (Qwen3-VL-30B-A3B, Qwen3.6-35B-A3B)
store 128 x 128 tiles; re-quantizing them per row changes greedy tokens (fp8_gemm.py), so until this kernel their
experts were dequantized to bf16 at load: twice the memory of the checkpoint for ~95% of a MoE's weights.

The recipe is the dense block layers' (fp8_gemm.block_linear): activations quantized per 1 x 128 group of each row
(fp8_act_quant.py, the same bits as fp8_quant.quantize_token_groups), each 128-wide K step a tensor-core product of
FP8 tiles in float32, scaled by the row's group scale and the weight tile's scale and accumulated in float32; one
rounding at the end. A K that is not whole groups (Gemma 4 26B-A4B's down projection: 704) has its activations
zero-padded to them (zeros change no group's scale) and the weight's last tile masked.

Rows come grouped by expert (qwen3_vl/moe.py ``experts_grouped`` sorts the token-expert pairs), ``ends`` the groups'
end offsets. The grid has a fixed size for a row count, ``ceil(R / TILE_M) + E`` row tiles (each expert adds at
most one partial tile) by the N tiles, so it has no host sync and can be captured in a CUDA graph: each program
finds its expert from ``ends`` (a cumulative count of the experts' tiles, in registers) and programs past the last
tile return at once. Neither the row count nor the group ends are specialised on.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.engine.kernels import fp8_act_quant, w8a16_gemm
from workers.engine.kernels.fp8_quant import (
    BLOCK,
    dequantize,
    quantize_block,
    quantize_token_groups,
)
from workers.engine.kernels.launch_helpers import pow2
from workers.engine.kernels.triton_switch import TritonSwitch

SWITCH = TritonSwitch("GLIMPSE_TRITON_FP8_GROUPED")
available = SWITCH.on  # on CUDA tensors, or anywhere under TRITON_INTERPRET=1

# Tiles, read at import (GLIMPSE_FP8_GROUPED_TILES="M,N,warps,stages") so moe_bench can compare them on the card.
TILE_M, TILE_N, NUM_WARPS, NUM_STAGES = (int(v) for v in os.environ.get("GLIMPSE_FP8_GROUPED_TILES", "64,128,4,3").split(","))


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["rows"])
    def grouped_block_kernel(q_ptr, sx_ptr, w_ptr, sw_ptr, ends_ptr, out_ptr, rows, N: tl.constexpr,
                             K: tl.constexpr, E: tl.constexpr, E_POW2: tl.constexpr, SCALE_ROWS: tl.constexpr,
                             ROWS_PER_SCALE: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        tile = tl.program_id(0)
        # Which expert's rows this program takes: the experts' tile counts, summed in id order.
        ex = tl.arange(0, E_POW2)
        in_range = ex < E
        ends = tl.load(ends_ptr + ex, mask=in_range, other=0)
        starts = tl.load(ends_ptr + ex - 1, mask=in_range & (ex > 0), other=0)
        counts = tl.where(in_range, ends - starts, 0)
        tiles = (counts + TILE_M - 1) // TILE_M
        last = tl.cumsum(tiles, 0)  # one past each expert's last tile
        expert = tl.sum((last <= tile).to(tl.int32), 0)
        if expert < E:
            mine = ex == expert
            first_tile = tl.sum(tl.where(mine, last - tiles, 0), 0)
            end = tl.sum(tl.where(mine, ends, 0), 0)
            r = tl.sum(tl.where(mine, starts, 0), 0) + (tile - first_tile) * TILE_M + tl.arange(0, TILE_M)
            r_ok = r < end
            r64 = r.to(tl.int64)
            n = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
            n_ok = n < N
            e64 = expert.to(tl.int64)
            w_rows = w_ptr + e64 * N * K + n.to(tl.int64)[None, :] * K  # [1, TILE_N]: K is contiguous (K-major B)
            KB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
            KA: tl.constexpr = KB * BLOCK_K  # the activations' row: K zero-padded to whole groups
            sw_rows = sw_ptr + e64 * SCALE_ROWS * KB + (n // ROWS_PER_SCALE) * KB  # [TILE_N]: tiles or rows
            acc = tl.zeros([TILE_M, TILE_N], tl.float32)
            for kb in range(KB):
                k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
                a = tl.load(q_ptr + r64[:, None] * KA + k[None, :], mask=r_ok[:, None], other=0.0)
                if K % BLOCK_K:
                    b = tl.load(w_rows + k[:, None], mask=n_ok[None, :] & (k < K)[:, None], other=0.0)
                else:
                    b = tl.load(w_rows + k[:, None], mask=n_ok[None, :], other=0.0)
                sa = tl.load(sx_ptr + kb * rows + r64, mask=r_ok, other=0.0)  # token-major: scale [kb, row]
                sb = tl.load(sw_rows + kb, mask=n_ok, other=0.0)
                acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
            out = out_ptr + r64[:, None] * N + n[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])

    return grouped_block_kernel


def grouped_mm(
    rows: Tensor, weight: Tensor, scale: Tensor, ends: Tensor, tiles: tuple[int, int, int, int] | None = None
) -> Tensor:
    """rows [R, K] (grouped by expert, int32 group ends ``ends`` [E]) times each expert's FP8 weight [E, N, K] with
    block scales [E, ceil(N/128) or N, ceil(K/128)] (fp8_quant.is_block; fp8_gemm.grouped_usable says when) -> [R, N]
    in rows' dtype. ``tiles``: (TILE_M, TILE_N,
    warps, stages) other than the module's (fp8_gemm_bench --moe compares them)."""
    r, k = rows.shape
    e, n, _ = weight.shape
    tile_m, tile_n, warps, stages = tiles or (TILE_M, TILE_N, NUM_WARPS, NUM_STAGES)
    out = torch.empty((r, n), dtype=rows.dtype, device=rows.device)
    if not r:
        return out
    padded = F.pad(rows, (0, -k % BLOCK)) if k % BLOCK else rows  # zero columns change no group's scale
    q, sx = fp8_act_quant.quantize(padded) if fp8_act_quant.available() else fp8_act_quant.torch_ops(padded)
    _kernel()[(-(-r // tile_m) + e, -(-n // tile_n))](
        q, sx, weight.contiguous(), scale.float().contiguous(), ends.to(torch.int32).contiguous(), out, r,
        N=n, K=k, E=e, E_POW2=pow2(e), SCALE_ROWS=scale.shape[1], ROWS_PER_SCALE=1 if scale.shape[1] == n else BLOCK,
        TILE_M=tile_m, TILE_N=tile_n, BLOCK_K=BLOCK, num_warps=warps, num_stages=stages)
    return out


def reference(rows: Tensor, weight: Tensor, scale: Tensor, ends: Tensor) -> Tensor:
    """``grouped_mm``'s math in float32 eager torch: the activations quantized the same way, both operands
    dequantized, one product per expert's rows."""
    k = rows.shape[1]
    q, sx = quantize_token_groups(F.pad(rows, (0, -k % BLOCK)))
    x = dequantize(q, sx.repeat_interleave(BLOCK, dim=1))[:, :k]
    out = torch.zeros(rows.shape[0], weight.shape[1], dtype=torch.float32, device=rows.device)
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ dequantize(weight[e], scale[e]).t()
        start = end
    return out


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once against ``reference``; a Triton that cannot compile here or another answer turns it off
    for the process (those experts stay in the model dtype) rather than failing mid-serving."""
    gen = torch.Generator().manual_seed(0)
    # 3 experts, one of them empty, a group that spans tiles and one that ends mid-tile; N = 200 ends mid-block.
    # Activations on e4m3's grid (their quantization rounds nothing: the interpreter rounds otherwise than the GPU).
    x = w8a16_gemm.exact_rows(TILE_M + 9, 256, gen)
    q, s = quantize_block(torch.randn(3, 200, 256, generator=gen))
    ends = torch.tensor([TILE_M + 2, TILE_M + 2, TILE_M + 9], dtype=torch.int32)

    def check() -> bool:
        got = grouped_mm(x.to(device=device, dtype=dtype), q.to(device), s.to(device), ends.to(device))
        want = reference(x.to(dtype).float(), q, s, ends)
        err = (got.float().cpu() - want).pow(2).mean().sqrt()
        return bool(err <= 0.01 * want.pow(2).mean().sqrt())

    return SWITCH.probe(check)
