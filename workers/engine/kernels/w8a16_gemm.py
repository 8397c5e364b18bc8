"""y = x W^T (+ b) with W in FP8 and x in bf16/fp16, in Triton: FP8 decode steps on CUDA.

A decode step at a small batch streams every weight once and does little arithmetic with it, so its time is the
weights' bytes over the memory bandwidth. FP8 halves those bytes, but the scaled-FP8 GEMMs (fp8_gemm.py) also
quantize the activations in separate kernels and carry a fixed cost that lost to bf16 at 1-16 rows (0.09 ms against
0.018 ms for an 8B's qkv on an H200). Here each program streams a [BLOCK_N, K / SPLIT_K] strip of W as FP8 and
multiplies it on the tensor cores against x padded to BLOCK_M rows (16 at least, the smallest tl.dot), accumulating
in float32, in one of three ways (``Tile.mode``):
* FP8_ACTIVATIONS (the default, fastest on an H200): each [BLOCK_M, 128] tile of x is quantized in registers as
  fp8_quant.quantize_token_groups does (per row and 128 columns, absolute max to 448) and multiplied e4m3 x e4m3, so
  the weight tile goes to the tensor cores as it was read; the row scales multiply the float32 product. These are
  the numerics of the block recipe above 16 rows, without its quantization kernels.
* DOT: the weight tile widened to x's dtype in registers (e4m3 -> bf16 or fp16 is exact), x as it is (weight-only).
* FMA: products and sums on the CUDA cores, 1-4 rows a program (none padded to 16).
The weight's scales are dequantization factors (real = fp8 * scale, fp8_quant.py), applied to the float32
products, never to the weight in x's dtype, so the weight is rounded once (to FP8, by the checkpoint):
* per output channel ([N, 1]): once, on the accumulator after the K loop;
* 128 x 128 blocks ([ceil(N/128), ceil(K/128)]) and row blocks ([N, ceil(K/128)]): per K tile, on that tile's
  product (a tile never straddles a 128-column block: BLOCK_K divides 128 and splits start on BLOCK_K multiples).

Split-K as in skinny_gemm.py: a weight with too few output rows to fill the card splits K; each split writes a
float32 partial, summed in a fixed order with the bias (deterministic, no atomics) by skinny_gemm's second pass or,
where the caller takes them unsummed (``unsummed``), by the next RMSNorm's kernel (split_norm.py). Row counts above
BLOCK_M take more programs along M (BLOCK_M at most 64), so the kernel is correct at any M, but it is meant for
decode rows: fp8_gemm.py runs it up to its W8A16_MAX_ROWS under ``auto``.

On Hopper and later the weight's tiles come through the Tensor Memory Accelerator (a host tensor descriptor per
weight, ``TMA``): Qwen3-VL-8B's four projections at one row took 6-18 % less time than with per-thread loads, at 3
pipeline stages, and a block-FP8 decode step's kernels 3.370 -> 3.147 ms (H200, `decode_profile --quantize fp8-block`). ``GLIMPSE_W8A16_TMA=0`` keeps the per-thread loads. With 128 x 128
scale blocks and BLOCK_N dividing 128, a program's weight rows share one scale per K tile, loaded as one value.

The row count is not specialised on: a weight shape compiles once per BLOCK_M (16 for up to 16 rows). The start-up
warm-up's forwards run every projection at decode row counts, which compiles them before any CUDA-graph capture.
Tiles: ``tile`` picks one per shape; ``GLIMPSE_W8A16_TILE=block_n,block_k,split_k,warps,stages[,mode]`` forces one
(to serve a sweep's winner), and ``candidates`` lists what benchmarks/kernels/fp8_gemm_bench.py ``--sweep`` tries.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.engine.kernels import pdl, skinny_gemm
from workers.engine.kernels.fp8_quant import (
    BLOCK,
    FP8,
    FP8_MAX,
    dequantize,
    quantize_block,
    quantize_rows,
    quantize_token_groups,
)
from workers.engine.kernels.triton_switch import TritonSwitch

SWITCH = TritonSwitch("GLIMPSE_TRITON_W8A16")
available = SWITCH.on  # on CUDA tensors, or anywhere under TRITON_INTERPRET=1
TILE_ENV = "GLIMPSE_W8A16_TILE"
TMA_ENV = "GLIMPSE_W8A16_TMA"
MAX_BLOCK_M = 64


# How a tile multiplies (Tile.mode): DOT widens the weight to x's dtype for the tensor cores; FP8_ACTIVATIONS
# quantizes each row of x per K tile (fp8_quant's dynamic 1 x BLOCK_K groups) and runs e4m3 x e4m3 on the tensor
# cores, so the weight is never widened (the block recipe's numerics, computed in one kernel); FMA multiplies and
# sums on the CUDA cores, with x's rows not padded to 16 (few rows only: the work grows with them).
DOT, FP8_ACTIVATIONS, FMA = 0, 1, 2
MODE_NAMES = {"dot": DOT, "fp8-activations": FP8_ACTIVATIONS, "fma": FMA}
FMA_BLOCK_M = 4  # rows an FMA program holds (more rows take more programs)


class Tile(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int
    mode: int = DOT


# The default tile, by measurement (H200, `fp8_gemm_bench --sweep --sweep-modes dot,fp8-activations,fma`, Qwen3-VL-8B
# projections at 1 and 4 rows, session 36): FP8_ACTIVATIONS in 128 x 128 tiles took gate_up from 0.041 to 0.032 ms
# (bf16 0.050-0.056) and down from 0.024 to 0.021 (bf16 0.030); qkv stayed at 0.014 in every mode (bf16 0.015-0.016).
# K splits until the grid has PROGRAMS_PER_SM programs per multiprocessor while each split keeps MIN_SPLIT_K
# columns: the winning splits there (8 for qkv and down, 2 for gate_up; 1.5 waves of 132 SMs lands on all three).
DEFAULT = Tile(block_n=128, block_k=128, split_k=1, warps=4, stages=4, mode=FP8_ACTIVATIONS)
# The stages of DEFAULT's tile when its weight comes through TMA: at one row of Qwen3-VL-8B's projections a TMA
# version of this kernel took 7.68 / 9.79 / 29.15 / 16.27 us (o, qkv, gate_up, down) at 3 stages against
# 8.14 / 10.59 / 29.16 / 16.49 at 4 (H200, graph-replayed over weight copies larger than L2).
TMA_STAGES = 3
PROGRAMS_PER_SM = 1.5
MIN_SPLIT_K = 512
FMA_MAX_ROWS = 0  # rows up to which the default tile multiplies on the CUDA cores (0: never; it won only qkv at 1 row, by 3 %)


def tile(n: int, k: int, sms: int, rows: int = 1, tma: bool = False) -> Tile:
    """The tile for a [rows, k] x [k, n] product on a card with ``sms`` multiprocessors (the weight's stream is
    the cost at any decode row count): ``GLIMPSE_W8A16_TILE`` if set, else DEFAULT with the split K needs (and
    TMA_STAGES where the weight comes through TMA), FMA up to FMA_MAX_ROWS rows."""
    forced = os.environ.get(TILE_ENV)
    if forced:
        return Tile(*(int(v) for v in forced.split(",")))
    want = int(PROGRAMS_PER_SM * sms)
    split = 1
    step = DEFAULT.block_k
    while -(-n // DEFAULT.block_n) * split < want and k // (2 * split) >= MIN_SPLIT_K and k % (2 * split * step) == 0:
        split *= 2
    stages = TMA_STAGES if tma else DEFAULT.stages
    return DEFAULT._replace(split_k=split, stages=stages, mode=FMA if rows <= FMA_MAX_ROWS else DEFAULT.mode)


@functools.cache
def _tma_capable(index: int) -> bool:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def tma_serves(weight: Tensor) -> bool:
    """Whether ``weight``'s tiles load through a TMA descriptor: a CUDA card of compute capability 9 or later, a
    Triton with host tensor descriptors, rows whose bytes are a multiple of 16 on a 16-byte aligned base, and
    GLIMPSE_W8A16_TMA not "0" (read on every call, so benchmarks can switch it)."""
    if not weight.is_cuda or os.environ.get(TMA_ENV, "1") == "0":
        return False
    aligned = weight.is_contiguous() and weight.shape[-1] % 16 == 0 and weight.data_ptr() % 16 == 0
    index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
    return aligned and _tma_capable(index)


def candidates(k: int, modes: tuple[int, ...] = (DOT,)) -> list[Tile]:
    """The tiles a sweep tries for an in-features ``k`` (benchmarks/kernels/fp8_gemm_bench.py ``--sweep``): earlier
    sweeps found 64-column K tiles, 3 or 6 stages no faster, and the widest N tiles best."""
    out = []
    for mode in modes:
        for block_n in (32, 64, 128, 256):
            for split in (1, 2, 4, 8, 16):
                if split > 1 and k // split < 2 * BLOCK:
                    continue
                for warps in (4, 8):
                    out.append(Tile(block_n, BLOCK, split, warps, 4, mode))
    return out


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["rows"])
    def w8a16_kernel(
        x_ptr, w_src, s_ptr, b_ptr, out_ptr, rows, n, k, k_split, stride_sn, stride_sk,
        HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, K_SCALES: tl.constexpr, ROW_DIV: tl.constexpr, MODE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
        TMA: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        k0 = pid_k * k_split
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * k + (k0 + offs_k)[None, :]
        if not TMA:  # W^T's [BLOCK_K, BLOCK_N] tile, read along W's contiguous rows (w_src: the weight)
            w_ptrs = w_src + offs_n[None, :].to(tl.int64) * k + (k0 + offs_k)[:, None]
        s_ptrs = s_ptr + (offs_n // ROW_DIV) * stride_sn  # each output row's scale row
        # 128 x 128 scale blocks and BLOCK_N dividing them: the program's rows share one scale per K tile
        ONE_SCALE: tl.constexpr = K_SCALES and ROW_DIV == SCALE_BLOCK and SCALE_BLOCK % BLOCK_N == 0
        s_one = s_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_sn
        m_ok = offs_m[:, None] < rows
        n_ok = offs_n[None, :] < n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PDL:  # waits only, as skinny_gemm's kernel does (pdl.py)
            tl.extra.cuda.gdc_wait()
        for kk in range(0, k_split, BLOCK_K):
            k_ok = k0 + kk + offs_k < k
            x = tl.load(x_ptrs, mask=m_ok & k_ok[None, :], other=0.0)
            if TMA:  # w_src: the weight's descriptor; rows and columns past its end come as zeros
                w = w_src.load([pid_n * BLOCK_N, k0 + kk]).T
            else:
                w = tl.load(w_ptrs, mask=n_ok & k_ok[:, None], other=0.0)
            if MODE == 0 and not K_SCALES:
                acc = tl.dot(x, w.to(x.dtype), acc)
            else:
                if MODE == 1:  # FP8_ACTIVATIONS: this tile's rows quantized as fp8_quant does, e4m3 tensor cores
                    xf = x.to(tl.float32)
                    xs = tl.maximum(tl.max(tl.abs(xf), axis=1) / 448.0, 1e-12)  # fp8_quant's FP8_MAX, _MIN_SCALE
                    xq = tl.clamp(xf / xs[:, None], -448.0, 448.0).to(w.dtype)
                    part = tl.dot(xq, w) * xs[:, None]
                elif MODE == 2:  # FMA: products and sums on the CUDA cores, no padding of the rows
                    part = tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
                else:
                    part = tl.dot(x, w.to(x.dtype))
                if ONE_SCALE:
                    part = part * tl.load(s_one + ((k0 + kk) // SCALE_BLOCK) * stride_sk, mask=k0 + kk < k, other=0.0)
                elif K_SCALES:  # this tile lies in one 128-column block: one scale per output row
                    s_ok = (offs_n < n) & (k0 + kk < k)
                    part = part * tl.load(s_ptrs + ((k0 + kk) // SCALE_BLOCK) * stride_sk, mask=s_ok, other=0.0)[None, :]
                acc += part
            x_ptrs += BLOCK_K
            if not TMA:
                w_ptrs += BLOCK_K
        if not K_SCALES:
            acc *= tl.load(s_ptrs, mask=offs_n < n, other=0.0)[None, :]
        if PARTIAL:
            dst = out_ptr + pid_k * rows * n + offs_m[:, None] * n + offs_n[None, :]
            tl.store(dst, acc, mask=m_ok & n_ok)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=offs_n < n, other=0.0).to(tl.float32)[None, :]
            dst = out_ptr + offs_m[:, None] * n + offs_n[None, :]
            tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok & n_ok)

    return w8a16_kernel


def block_m(rows: int, mode: int = DOT) -> int:
    if mode == FMA:
        return min(FMA_BLOCK_M, 1 << (rows - 1).bit_length())
    return min(MAX_BLOCK_M, max(16, 1 << (rows - 1).bit_length()))


def linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None, use: Tile | None = None) -> Tensor:
    """x [..., K] (bf16/fp16/fp32) times an FP8 weight [N, K] with dequantization scales per output channel
    ([N, 1]), per 128 x 128 block or per row and 128 columns (fp8_quant.py), plus the bias; x's dtype out.
    ``use`` overrides the tile (benchmarks)."""
    lead = x.shape[:-1]
    y = skinny_gemm.settled(unsummed(x.reshape(-1, x.shape[-1]), weight, scale, bias, use))
    return y.reshape(*lead, weight.shape[0])


def unsummed(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None, use: Tile | None = None
) -> Tensor | skinny_gemm.Partials:
    """``linear`` for x [rows, K], but where the tile splits K the float32 partials are returned unsummed (for the
    kernel after this one to sum: skinny_gemm.Partials)."""
    n, k = weight.shape
    if weight.dtype != FP8:
        raise ValueError(f"w8a16 takes float8_e4m3fn weights, not {weight.dtype}")
    x2 = x.contiguous()
    rows = x2.shape[0]
    if rows == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    tma = tma_serves(weight)
    t = use or tile(n, k, skinny_gemm.sm_count(x.device), rows, tma)
    if use is None and rows > MAX_BLOCK_M:  # the M blocks give the grid its programs: no partials to sum
        t = t._replace(split_k=1)
    s = scale.float()
    channel = s.shape[-1] == 1 and s.shape[-2] == n
    # FP8_ACTIVATIONS quantizes x per K tile: always 128 columns, the recipe's groups, whatever the tile asks
    block_k = BLOCK if t.mode == FP8_ACTIVATIONS else t.block_k if channel else min(t.block_k, BLOCK)
    if not channel and BLOCK % block_k:
        raise ValueError(f"w8a16: BLOCK_K {block_k} must divide the {BLOCK}-column scale blocks")
    k_split = -(-k // (t.split_k * block_k)) * block_k
    bm = block_m(rows, t.mode)
    grid = (-(-n // t.block_n), t.split_k, -(-rows // bm))
    split = t.split_k > 1  # then float32 partials, summed (with the bias) after this kernel
    shape, dtype = ((t.split_k, rows, n), torch.float32) if split else ((rows, n), x.dtype)
    dst = torch.empty(shape, dtype=dtype, device=x.device)
    w: Any = weight.contiguous()
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w = TensorDescriptor.from_tensor(w, [t.block_n, block_k])
    _kernel()[grid](
        x2, w, s, bias if bias is not None else s, dst, rows, n, k, k_split, s.stride(0), s.stride(1),
        HAS_BIAS=bias is not None and not split, PARTIAL=split, K_SCALES=not channel,
        ROW_DIV=1 if s.shape[0] == n else BLOCK, MODE=t.mode, BLOCK_M=bm, BLOCK_N=t.block_n, BLOCK_K=block_k,
        SCALE_BLOCK=BLOCK, TMA=tma, num_warps=t.warps, num_stages=t.stages, **pdl.launch(x.device),
    )  # fmt: skip
    return skinny_gemm.Partials(dst, bias, x.dtype) if split else dst


def fp8_groups(x: Tensor) -> Tensor:
    """x [..., K] in float32 as FP8_ACTIVATIONS sees it: each row's 128 columns quantized to e4m3 with their own
    scale (fp8_quant.quantize_token_groups), dequantized."""
    k = x.shape[-1]
    q, s = quantize_token_groups(F.pad(x.float().reshape(-1, k), (0, -k % BLOCK)))
    return (q.float() * s.repeat_interleave(BLOCK, dim=1))[:, :k].reshape(x.shape)


def exact_rows(rows: int, k: int, gen: torch.Generator) -> Tensor:
    """float32 x [rows, k] that FP8_ACTIVATIONS re-quantizes without rounding in float32, float16 or bfloat16:
    e4m3 values with a 448 in each 128 columns, times 2^-8, so every group's scale is 2^-8 exactly (Triton's
    interpreter rounds float32 -> e4m3 otherwise than the GPU; on this grid nothing rounds)."""
    x = (torch.randn(rows, k, generator=gen) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
    x[:, ::BLOCK] = FP8_MAX
    return x * 2.0**-8


def reference(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None, mode: int = DOT) -> Tensor:
    """The same product in float32 with the weight dequantized first (any device); for FP8_ACTIVATIONS with x
    through ``fp8_groups`` first, as that mode's 128-column tiles do."""
    y = (fp8_groups(x) if mode == FP8_ACTIVATIONS else x.float()) @ dequantize(weight, scale).t()
    return y if bias is None else y + bias.float()


def spread_weight(n: int, k: int, gen: torch.Generator) -> Tensor:
    """A float32 weight [n, k] whose 128 x 128 blocks and rows differ in magnitude by up to 2^6 and 4x, so a
    scale read from the wrong block or row is far off (Gaussian blocks alone would all have about one scale)."""
    blocks = torch.exp2(torch.randint(-3, 4, (-(-n // BLOCK), -(-k // BLOCK)), generator=gen).float())
    rows = 0.25 + torch.rand(n, 1, generator=gen)
    return torch.randn(n, k, generator=gen) * rows * blocks.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once per scale layout (channel, 128 x 128 blocks, row blocks; with and without a K split)
    against ``reference``; a Triton that cannot compile here or a wrong answer turns it off for the process
    (fp8_gemm.py's other variants serve instead) rather than failing mid-serving."""
    gen = torch.Generator().manual_seed(0)
    x = exact_rows(3, 384, gen).to(device=device, dtype=dtype)  # one tolerance then holds every mode
    w = spread_weight(200, 384, gen)  # partial tiles along N
    b = torch.randn(200, generator=gen).to(device=device, dtype=dtype)
    qb, sb = quantize_block(w)
    qr, sr = quantize_rows(w)
    layouts = ((qb, sb), (qb, sb.repeat_interleave(BLOCK, dim=0)[:200]), (qr, sr))
    modes = sorted({DOT, DEFAULT.mode} | ({FMA} if FMA_MAX_ROWS else set()))

    def check() -> bool:
        for q, s in layouts:
            q, s = q.to(device), s.to(device)
            for mode in modes:
                want = reference(x, q, s, b, mode)
                for split in (1, 3):
                    got = linear(x, q, s, b, use=Tile(32, 64, split, 4, 2, mode)).float()
                    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
                        return False
        return True

    return SWITCH.probe(check)
