"""The routed experts of a few tokens in Triton: the decode step's MoE on CUDA, in four kernels.

At decode a MoE layer multiplies each of a handful of tokens by its k experts' weights. The grouped-GEMM path
(qwen3_vl/moe.py ``experts_grouped``) sorts the token-expert pairs, gathers rows, runs two grouped GEMMs over every
expert (most of them empty at batch 1) and scatters and sums the results: about fifteen kernels a layer, whose launch
and tail costs, not the weights they read, set a batch-1 step's time (Qwen3.6-35B-A3B reads 48 MiB of expert weights
a layer, 10 us at an H200's bandwidth). Here:

* ``route``: softmax over the router logits in float32, the top k by k rounds of arg-max (ties to the lower id),
  the k weights renormalised to sum to 1 and optionally scaled per expert (Gemma 4): one program per token.
* ``expert_up``: one program per (token-expert pair, block of intermediate rows) reads that block of the expert's
  gate and up rows and writes act(gate) * up for the pair; the activation is SiLU or tanh-GELU.
* ``expert_down``: one program per (token-expert pair, block of hidden rows) runs that block of the expert's down
  rows over the pair's activations, times its routing weight, into a float32 partial per pair;
* ``sum_pairs``: each token's k partials summed in a fixed order: deterministic (no atomics). A program per token
  that looped over its k experts itself (no partials, no fourth kernel) kept too few loads in flight: Gemma 4
  26B-A4B's experts took 44.6 against 41.3 us a layer at 1 row, 117 against 106 at 4 and 346 against 300 at 16, and
  its batch-1 decode step 2.23 against 2.02 ms with 12 layers (H200, moe_bench --sweep, decode_profile).

FP8 expert stacks (``experts(..., scales=)``, one scale per row) are read as FP8 and widened in registers, the
scales applied to the float32 products. The accumulation is float32 and each output rounds once. Rows are never a kernel argument, so a layer's kernels
compile once per weight shape (nothing may compile inside a CUDA-graph capture; the start-up warm-up's forwards
compile them). The kernels read an expert's rows once per token that chose it, the grouped GEMMs once per expert:
above ``PAIR_MAX_ROWS`` rows of bf16 stacks moe_batched.py's kernels (one program per expert and block of columns,
each chosen expert read once, up to its own ``MAX_ROWS``) take the up and down products between this routing and
this sum; above those rows, and FP8 stacks above ``MAX_ROWS``, the grouped GEMMs serve.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels import moe_batched
from workers.engine.kernels.fp8_quant import BLOCK, FP8, dequantize, is_block, quantize_block, quantize_rows
from workers.engine.kernels.launch_helpers import pow2
from workers.engine.kernels.triton_switch import TritonSwitch

# Token rows up to which the kernels serve a MoE layer. H200, 20 layers replayed from a graph, randomly routed rows
# (`python -m benchmarks.kernels.moe_bench`): per layer 30-45 us at 1 row against 98-122 us for the grouped GEMMs,
# 68-117 against 158-216 at 4, 195-345 against 317-444 at 16. The kernels read an expert once per token that chose
# it, so rows that all share their experts cost them more: 16 copies of one prompt decoding made a 35B-A3B step
# 6.65 -> 7.49 ms. Requests decoding side by side route apart, as the random rows do.
MAX_ROWS = 16
# Above this many rows bf16 stacks take moe_batched.py's kernels (FP8 stacks stay per pair to MAX_ROWS): each chosen
# expert read once. Per layer, 20 layers replayed from a graph (moe_bench, H200), per pair against batched at 8 / 16
# rows: Qwen3-VL-30B-A3B 137.2 / 232.6 against 133.1 / 207.7 us, Gemma 4 26B-A4B 177.9 / 300.4 against 168.0 / 263.3,
# Qwen3.6-35B-A3B 106.0 / 177.7 against 107.2 / 177.9; at 4 rows per pair wins (83.2 against 86.0 us on the 30B).
PAIR_MAX_ROWS = 8
# Tiles and warps: the best at 1, 4 and 16 rows on the Qwen3.5 and Gemma 4 MoE shapes (moe_bench --sweep, H200).
UP_BLOCK_N, UP_BLOCK_K = 16, 256
DOWN_BLOCK_N, DOWN_BLOCK_K = 16, 256
assert BLOCK % UP_BLOCK_N == 0 and BLOCK % DOWN_BLOCK_N == 0  # a program's rows share one row of 128 x 128 scales
NUM_WARPS = 8
SUM_BLOCK = 1024

SWITCH = TritonSwitch("GLIMPSE_TRITON_MOE")
available = SWITCH.on  # on CUDA tensors, or anywhere under TRITON_INTERPRET=1
# FP8 expert stacks (per-row scales) through the same kernels: probed apart (``probe_fp8``, when fp8_layers.py makes
# the stacks FP8), so a Triton without FP8 loads keeps the bf16 experts on the kernels.
FP8_SWITCH = TritonSwitch("GLIMPSE_TRITON_MOE_FP8")


@functools.cache
def _kernels() -> tuple[Any, Any, Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def route_kernel(logits_ptr, scale_ptr, weights_ptr, ids_ptr, E: tl.constexpr, E_POW2: tl.constexpr,
                     K: tl.constexpr, K_POW2: tl.constexpr, HAS_SCALE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, E_POW2)
        valid = cols < E
        z = tl.load(logits_ptr + row * E + cols, mask=valid, other=-float("inf")).to(tl.float32)
        p = tl.exp(z - tl.max(z, 0))
        p = tl.where(valid, p / tl.sum(p, 0), -1.0)  # padding never wins a round
        slots = tl.arange(0, K_POW2)
        top = tl.zeros([K_POW2], tl.float32)
        ids = tl.zeros([K_POW2], tl.int32)
        for j in tl.static_range(K):
            best = tl.max(p, 0)
            pick = tl.min(tl.where(p == best, cols, E_POW2), 0)
            top = tl.where(slots == j, best, top)
            ids = tl.where(slots == j, pick, ids)
            p = tl.where(cols == pick, -1.0, p)
        chosen = slots < K
        top = top / tl.sum(tl.where(chosen, top, 0.0), 0)
        if HAS_SCALE:
            top = top * tl.load(scale_ptr + ids, mask=chosen, other=1.0).to(tl.float32)
        tl.store(weights_ptr + row * K + slots, top, mask=chosen)
        tl.store(ids_ptr + row * K + slots, ids.to(tl.int64), mask=chosen)

    @triton.jit
    def expert_up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, h_ptr, H: tl.constexpr, INTER: tl.constexpr,
                         K: tl.constexpr, GELU: tl.constexpr, FP8: tl.constexpr, BLOCKS: tl.constexpr,
                         SCALE_ROWS: tl.constexpr, ROWS_PER_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        pair = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < INTER
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        x_row = x_ptr + (pair // K) * H
        gate_rows = w_ptr + expert * (2 * INTER * H) + rows[:, None].to(tl.int64) * H
        up_rows = gate_rows + INTER * H
        KB: tl.constexpr = (H + 127) // 128
        if BLOCKS:  # block scales: one per (scale row, 128 columns), folded into x's columns
            stack = s_ptr + expert * (SCALE_ROWS * KB)
            if ROWS_PER_SCALE == 1:  # per row and 128 columns
                gate_scales = stack + rows[:, None] * KB
                up_scales = gate_scales + INTER * KB
            else:  # 128 x 128 tiles: BLOCK_N divides 128 and INTER is whole BLOCK_N blocks: the rows share one tile row
                first = tl.program_id(1) * BLOCK_N
                gate_scales = stack + (first // 128) * KB
                up_scales = stack + ((INTER + first) // 128) * KB
        # Products accumulate elementwise and are reduced once at the end: a reduction per tile would cost more
        # than the tile's loads.
        gate_acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        up_acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.range(0, H, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < H
            xv = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tile_ok = row_ok[:, None] & col_ok[None, :]
            xg = xv
            xu = xv
            if BLOCKS:
                if ROWS_PER_SCALE == 1:
                    xg = xv * tl.load(gate_scales + (cols // 128)[None, :], mask=tile_ok, other=0.0)
                    xu = xv * tl.load(up_scales + (cols // 128)[None, :], mask=tile_ok, other=0.0)
                else:
                    xg = xv * tl.load(gate_scales + cols // 128, mask=col_ok, other=0.0)[None, :]
                    xu = xv * tl.load(up_scales + cols // 128, mask=col_ok, other=0.0)[None, :]
            gate_acc += tl.load(gate_rows + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32) * xg
            up_acc += tl.load(up_rows + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32) * xu
        gate = tl.sum(gate_acc, axis=1)
        up = tl.sum(up_acc, axis=1)
        if FP8 and not BLOCKS:  # one dequantization scale per expert row ([E, 2I, 1]): applied once, to the row's sum
            scales = s_ptr + expert * (2 * INTER) + rows
            gate *= tl.load(scales, mask=row_ok, other=0.0)
            up *= tl.load(scales + INTER, mask=row_ok, other=0.0)
        if GELU:  # tanh approximation, tanh(y) written as 1 - 2 / (exp(2y) + 1)
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
        else:
            act = gate / (1.0 + tl.exp(-gate))
        tl.store(h_ptr + pair * INTER + rows, (act * up).to(h_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def expert_down_kernel(h_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, part_ptr, H: tl.constexpr,
                           INTER: tl.constexpr, FP8: tl.constexpr, BLOCKS: tl.constexpr, SCALE_ROWS: tl.constexpr,
                           ROWS_PER_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pair = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < H
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        down_rows = w_ptr + expert * (H * INTER) + rows[:, None].to(tl.int64) * INTER
        KB: tl.constexpr = (INTER + 127) // 128
        if BLOCKS:  # as in the up kernel
            stack = s_ptr + expert * (SCALE_ROWS * KB)
            if ROWS_PER_SCALE == 1:
                scales = stack + rows[:, None] * KB
            else:
                scales = stack + (tl.program_id(1) * BLOCK_N // 128) * KB
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.range(0, INTER, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < INTER
            tile_ok = row_ok[:, None] & col_ok[None, :]
            hv = tl.load(h_ptr + pair * INTER + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if BLOCKS:
                if ROWS_PER_SCALE == 1:
                    hv = hv * tl.load(scales + (cols // 128)[None, :], mask=tile_ok, other=0.0)
                else:
                    hv = hv * tl.load(scales + cols // 128, mask=col_ok, other=0.0)[None, :]
            acc += tl.load(down_rows + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32) * hv
        y = tl.sum(acc, axis=1) * tl.load(weights_ptr + pair).to(tl.float32)
        if FP8 and not BLOCKS:  # one scale per (expert, row): it factors out of the row's sum
            y *= tl.load(s_ptr + expert * H + rows, mask=row_ok, other=0.0)
        tl.store(part_ptr + pair * H + rows, y, mask=row_ok)

    @triton.jit
    def sum_pairs_kernel(part_ptr, out_ptr, H: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < H
        acc = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(K):  # a fixed order: the sum does not depend on timing
            acc += tl.load(part_ptr + (token * K + j) * H + cols, mask=ok, other=0.0)
        tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)

    return route_kernel, expert_up_kernel, expert_down_kernel, sum_pairs_kernel


def wanted(x: Tensor, gate_up: Tensor) -> bool:
    """Whether a MoE layer should take these kernels for x [T, H]: a few rows, weights in x's dtype or FP8 with
    per-row scales (the caller passes them to ``experts``), the kernels on; or a decode batch's rows that
    moe_batched.py's kernels take (with this routing and the per-token sum)."""
    if x.shape[0] > MAX_ROWS:
        return available() and moe_batched.wanted(x, gate_up)
    return (
        0 < x.shape[0]
        and (gate_up.dtype == x.dtype or (gate_up.dtype == FP8 and FP8_SWITCH.on()))
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.is_cuda
        and available()
    )


def _batched(rows: int, scales: tuple[Tensor, Tensor] | None) -> bool:
    """Whether ``experts`` runs moe_batched.py's kernels for these rows (else the per-pair ones)."""
    if scales is not None:
        return rows > MAX_ROWS and moe_batched.fp8_on()
    return rows > PAIR_MAX_ROWS and moe_batched.available()


def route(logits: Tensor, top_k: int, per_expert_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """logits [T, E] -> (float32 weights [T, k] summing to 1, times ``per_expert_scale[id]`` if given; int64 ids
    [T, k] in descending probability)."""
    rows, experts = logits.shape
    weights = torch.empty((rows, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((rows, top_k), dtype=torch.int64, device=logits.device)
    if rows:
        scale = per_expert_scale if per_expert_scale is not None else weights  # a pointer the kernel never reads
        _kernels()[0][(rows,)](logits.contiguous(), scale, weights, ids, E=experts, E_POW2=pow2(experts),
                               K=top_k, K_POW2=pow2(top_k), HAS_SCALE=per_expert_scale is not None, num_warps=4)
    return weights, ids


def experts(
    x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, gelu: bool = False,
    scales: tuple[Tensor, Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """sum_j weights[t, j] * down[e] (act(gate[e] x_t) * up[e] x_t), e = ids[t, j], for x [T, H]; ``gate_up``
    [E, 2I, H] (each expert's gate rows, then its up rows) and ``down`` [E, H, I] as StackedExperts holds them.
    FP8 stacks come with ``scales`` (fp8_layers.py's experts), read as FP8, half the bytes: per-row dequantization
    factors [E, 2I, 1] and [E, H, 1], applied to the float32 sums; or block scales (fp8_quant.is_block: per 128 x 128
    tile, I then whole tiles, or per row and 128 columns), applied to x's columns."""
    rows, hidden = x.shape
    top_k = ids.shape[1]
    inter = down.shape[2]
    fp8 = gate_up.dtype == FP8
    if fp8 != (scales is not None) or fp8 != (down.dtype == FP8):
        raise ValueError("FP8 expert stacks take scales, and only they do")
    up_layout = down_layout = moe_batched.NO_SCALES
    if scales is not None:
        up_layout, down_layout = _scale_layout(gate_up, scales[0], inter), _scale_layout(down, scales[1], 0)
    if _batched(rows, scales):  # a decode batch: one program per expert and block of columns
        return _per_expert(x, weights, ids, gate_up, down, gelu, scales, (up_layout, down_layout))
    h = torch.empty((rows * top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    if not rows:
        return out
    _, up_kernel, down_kernel, _ = _kernels()
    ids = ids.contiguous()
    s_up, s_down = (scales[0].float().contiguous(), scales[1].float().contiguous()) if scales else (h, h)
    up_kernel[(rows * top_k, -(-inter // UP_BLOCK_N))](
        x.contiguous(), ids, gate_up.contiguous(), s_up, h, H=hidden, INTER=inter, K=top_k, GELU=gelu, FP8=fp8,
        BLOCKS=up_layout[0], SCALE_ROWS=up_layout[1], ROWS_PER_SCALE=up_layout[2],
        BLOCK_N=UP_BLOCK_N, BLOCK_K=UP_BLOCK_K, num_warps=NUM_WARPS)
    part = torch.empty((rows * top_k, hidden), dtype=torch.float32, device=x.device)
    down_kernel[(rows * top_k, -(-hidden // DOWN_BLOCK_N))](
        h, ids, weights.contiguous(), down.contiguous(), s_down, part, H=hidden, INTER=inter, FP8=fp8,
        BLOCKS=down_layout[0], SCALE_ROWS=down_layout[1], ROWS_PER_SCALE=down_layout[2],
        BLOCK_N=DOWN_BLOCK_N, BLOCK_K=DOWN_BLOCK_K, num_warps=NUM_WARPS)
    return _sum_pairs(part, out, top_k)


def _per_expert(
    x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, gelu: bool,
    scales: tuple[Tensor, Tensor] | None, layouts: tuple[moe_batched.Layout, moe_batched.Layout],
) -> Tensor:  # fmt: skip
    """``experts`` through moe_batched.py's kernels: the up and down products a program per expert, then the sum."""
    h = moe_batched.up(x, ids, gate_up, gelu, scales[0] if scales else None, layouts[0])
    part = moe_batched.down(h, ids, weights, down, scales[1] if scales else None, layouts[1])
    return _sum_pairs(part, torch.empty_like(x), ids.shape[1])


def _sum_pairs(part: Tensor, out: Tensor, top_k: int) -> Tensor:
    """out [T, H] = each token's k float32 partials part [T * k, H] summed in a fixed order, rounded once."""
    rows, hidden = out.shape
    if rows:
        _kernels()[3][(rows, -(-hidden // SUM_BLOCK))](part, out, H=hidden, K=top_k, BLOCK=SUM_BLOCK, num_warps=4)
    return out


def _scale_layout(stack: Tensor, scale: Tensor, tile_rows: int) -> tuple[bool, int, int]:
    """(block scales?, the scale tensor's rows, rows per scale row) of an FP8 stack's scales, for the kernels;
    ``tile_rows``: the gate half of gate_up, after which the up rows start: with 128 x 128 scales each program's
    UP_BLOCK_N rows must fall in one tile, so it must be whole blocks of UP_BLOCK_N (tiles may span gate and up)."""
    rows = stack.shape[1]
    if tuple(scale.shape) == (stack.shape[0], rows, 1):
        return False, rows, 1
    if not is_block(stack, scale):
        raise ValueError(f"expert scales {tuple(scale.shape)} fit neither rows nor blocks of {tuple(stack.shape)}")
    if scale.shape[1] == rows:
        return True, rows, 1
    if tile_rows % UP_BLOCK_N:
        raise ValueError(f"128 x 128 expert scales need gate rows in whole blocks of {UP_BLOCK_N}, not {tile_rows}")
    return True, scale.shape[1], BLOCK


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernels once against eager math; a Triton that cannot compile here or a wrong answer turns them
    off for the process (the grouped GEMMs or the loop serve instead) rather than failing mid-serving."""
    gen = torch.Generator().manual_seed(0)
    e, k, hidden, inter = 12, 3, 200, 72  # sizes that leave partial blocks in every dimension

    def check() -> bool:
        x = torch.randn(2, hidden, generator=gen).to(device=device, dtype=dtype)
        logits = torch.randn(2, e, generator=gen).to(device=device, dtype=dtype)
        gate_up = (torch.randn(e, 2 * inter, hidden, generator=gen) / hidden**0.5).to(device=device, dtype=dtype)
        down = (torch.randn(e, hidden, inter, generator=gen) / inter**0.5).to(device=device, dtype=dtype)
        weights, ids = route(logits, k)
        probs = torch.softmax(logits.float(), dim=-1)
        want_top, want_ids = torch.topk(probs, k, dim=-1)
        if not torch.equal(ids, want_ids):
            return False
        if not torch.allclose(weights, want_top / want_top.sum(-1, keepdim=True), rtol=1e-4, atol=1e-5):
            return False
        got = experts(x, weights, ids, gate_up, down).float()
        want = reference(x.float(), weights, ids, gate_up.float(), down.float())
        return torch.allclose(got, want, rtol=3e-2, atol=3e-2)

    return SWITCH.probe(check)


def probe_batched(device: torch.device, dtype: torch.dtype) -> bool:
    """moe_batched.py's kernels once through ``experts`` (routing and sum included) at more than ``PAIR_MAX_ROWS`` rows,
    against ``reference``, with partial blocks everywhere and an expert with more pairs than one pass serves."""
    gen = torch.Generator().manual_seed(2)

    def check() -> bool:
        e, k, hidden, inter, rows = 3, 2, 136, 72, MAX_ROWS + 9  # 50 pairs: an expert has more than 16
        x = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=dtype)
        logits = torch.randn(rows, e, generator=gen).to(device=device, dtype=dtype)
        gate_up = (torch.randn(e, 2 * inter, hidden, generator=gen) / hidden**0.5).to(device=device, dtype=dtype)
        down = (torch.randn(e, hidden, inter, generator=gen) / inter**0.5).to(device=device, dtype=dtype)
        weights, ids = route(logits, k)
        got = experts(x, weights, ids, gate_up, down).float()
        want = reference(x.float(), weights, ids, gate_up.float(), down.float())
        return torch.allclose(got, want, rtol=3e-2, atol=3e-2)

    return SWITCH.on() and moe_batched.SWITCH.probe(check)


def probe_fp8(device: torch.device, dtype: torch.dtype) -> bool:
    """The per-pair up and down kernels once on FP8 stacks with each scale layout (per row; 128 x 128 tiles; per row
    and 128 columns), against ``reference`` on the dequantized weights; whether FP8 stacks may take them here."""
    return SWITCH.on() and FP8_SWITCH.probe(functools.partial(_fp8_check, device, dtype, 2))


def probe_batched_fp8(device: torch.device, dtype: torch.dtype) -> bool:
    """moe_batched.py's kernels the same way at more than ``MAX_ROWS`` rows, called through them whether or not
    serving has opted in (``moe_batched.fp8_on``): whether FP8 stacks may take them."""
    if not (SWITCH.on() and moe_batched.SWITCH.on()):
        return False
    return moe_batched.FP8_SWITCH.probe(functools.partial(_fp8_check, device, dtype, MAX_ROWS + 3, batched=True))


def _fp8_check(device: torch.device, dtype: torch.dtype, rows: int, batched: bool = False) -> bool:
    gen = torch.Generator().manual_seed(1)

    def ragged(*shape: int) -> Tensor:  # 128 x 128 tiles of magnitudes 1 to 2^4 apart: a misread scale shows
        w = torch.randn(*shape, generator=gen)
        tiles = torch.arange(-(-shape[1] // BLOCK))[:, None] + 3 * torch.arange(-(-shape[2] // BLOCK))[None, :]
        return w * torch.exp2(tiles % 5).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: shape[1], : shape[2]]

    def case(inter: int, quantize: Any) -> bool:
        hidden = 200  # a partial 128-column block
        x = (torch.randn(rows, hidden, generator=gen) / 32).to(device=device, dtype=dtype)  # SiLU's exp in range
        q_gu, s_gu = (t.to(device) for t in quantize(ragged(6, 2 * inter, hidden)))
        q_d, s_d = (t.to(device) for t in quantize(ragged(6, hidden, inter)))
        weights, ids = route(torch.randn(rows, 6, generator=gen).to(device), 2)
        if batched:  # the kernels themselves, as ``experts`` calls them once FP8 batches are on
            layouts = (_scale_layout(q_gu, s_gu, inter), _scale_layout(q_d, s_d, 0))
            got = _per_expert(x, weights, ids, q_gu, q_d, False, (s_gu, s_d), layouts).float()
        else:
            got = experts(x, weights, ids, q_gu, q_d, scales=(s_gu, s_d)).float()
        want = reference(x.float(), weights, ids, dequantize(q_gu, s_gu), dequantize(q_d, s_d))
        return torch.allclose(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))

    def row_blocks(w: Tensor) -> tuple[Tensor, Tensor]:
        q, s = quantize_block(w)
        return q, s.repeat_interleave(BLOCK, dim=1)[:, : w.shape[1]]

    return case(40, quantize_rows) and case(128, quantize_block) and case(40, row_blocks)


def reference(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, gelu: bool = False) -> Tensor:
    """The kernels' math in eager torch (float32 in, float32 out): for checks and benchmarks."""
    act = functools.partial(torch.nn.functional.gelu, approximate="tanh") if gelu else torch.nn.functional.silu
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (gate_up[e].float() @ x[t].float()).chunk(2)
            out[t] += weights[t, j].float() * (down[e].float() @ (act(g) * u))
    return out
