"""The residual add and RMSNorm after a split-K decode projection, with the split sum in the same kernel.

At decode row counts the o and down projections have too few output features to fill the card, so their GEMMs
(skinny_gemm.py, w8a16_gemm.py) split K and write float32 partials. Summing them was a kernel of its own, then the
residual add and norm another: at batch 1 on an H200 the 72 sums of a Qwen3-VL-8B step took 0.089 ms of kernels (bf16;
144 sums and 0.25 ms in block FP8, where every projection splits), and each was one more launch in the graph
(`python -m benchmarks.engine.decode_profile --shape qwen3-8b --layers 0`). Here one program per row loads the
partials together, sums them in an order fixed by the kernel's layout (deterministic, though not the sum pass's
order: the last bits of the sum can differ from it), rounds the sum and the bias to the activations' dtype as the
sum pass does, adds the residual and normalises the row as ``RMSNorm.add`` does, one kernel fewer per projection.

Only decode rows come here (the GEMMs split K for at most 64 rows: fp8_gemm.W8A16_MAX_ROWS), so a row fits one
program: the hidden size, padded to a power of two, in registers. The row count is not specialised on; the split count and width are
constants of a model, compiled by the start-up warm-up's forwards before any CUDA-graph capture.

The same kernel serves every other RMSNorm of the LM on CUDA (``add_rms_norm_rows``, ``rms_norm_rows``: a plain
residual, or none), for its launch: the compiled norm it replaces is one Inductor kernel at the card's bandwidth, but
each call from Python went through Dynamo's guards and the compiled graph's wrapper, ~140 us of host time a call
under the profiler (`decode_profile --shape qwen3-8b --layers 0 --phase prefill --quantize fp8-block --host`, H200:
73 norms a 4,096-token step, ~10 ms of its host time). An eager prefill step of a dense model launches its kernels
from Python, and in block FP8 its GPU work (60 ms) is shorter than that host time (74 ms a step), so the host bounds
the step there. A Triton launch is a few microseconds of Python.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels import pdl
from workers.engine.kernels.skinny_gemm import Partials
from workers.engine.kernels.triton_switch import TritonSwitch

SWITCH = TritonSwitch("GLIMPSE_SPLIT_NORM")
available = SWITCH.on  # off: the projections sum their partials themselves, and the norm is the compiled one
ROWS_SWITCH = TritonSwitch("GLIMPSE_TRITON_NORM")
rows_available = ROWS_SWITCH.on  # off: a norm of plain rows (or after a plain residual) is the compiled one
# The widest row a program holds (Gemma 4 31B's 5,376 pads to 8,192)
MAX_WIDTH = 16384
# What the residual is: none (a plain norm), a tensor of x's shape and dtype, or a split-K product's partials
NO_DELTA, DENSE_DELTA, SPLIT_DELTA = 0, 1, 2
# Partial floats one program loads at once (16 warps x 32 threads x 64 registers): a 4,096-wide row's 8 splits.
_REGISTER_FLOATS = 32768


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["rows"])
    def split_add_norm_kernel(
        x_ptr, part_ptr, bias_ptr, w_ptr, sum_ptr, out_ptr, rows, n, eps,
        SPLIT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
        DELTA: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # pdl.py: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0).to(tl.int64)  # rows x n passes 2**31 elements in a long prefill step of a wide model
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        dtype = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * n + offs, mask=ok, other=0.0)
        if DELTA == 0:  # NO_DELTA: a plain norm
            total = x
        else:
            if DELTA == 2:  # SPLIT_DELTA
                g = tl.arange(0, GROUP)
                acc = tl.zeros((BLOCK,), dtype=tl.float32)
                # GROUP splits in one load, all in flight together: one load per split, each waiting for the last,
                # took ~0.6 us a split (4.9 us for 8 splits of a 4,096-wide row, H200). The sum order is fixed by the
                # layout.
                for s0 in tl.static_range(0, SPLIT, GROUP):
                    src = part_ptr + ((s0 + g)[:, None] * rows + row) * n + offs[None, :]
                    acc += tl.sum(tl.load(src, mask=ok[None, :], other=0.0), axis=0)
                if HAS_BIAS:
                    acc += tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                delta = acc.to(dtype)  # the projection's output, as the sum pass rounds it
            else:  # DENSE_DELTA
                delta = tl.load(part_ptr + row * n + offs, mask=ok, other=0.0)
            # the residual stream in its dtype: one add rounded once, as torch's
            total = (x.to(tl.float32) + delta.to(tl.float32)).to(dtype)
            tl.store(sum_ptr + row * n + offs, total, mask=ok)
        tf = total.to(tl.float32)
        inv = tl.rsqrt(tl.sum(tf * tf, axis=0) / n + eps)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        normed = (tf * inv).to(dtype)  # cast before the weight multiply, as RMSNorm does
        tl.store(out_ptr + row * n + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=ok)

    return split_add_norm_kernel


def add_rms_norm(
    x: Tensor, delta: Partials, weight: Tensor, eps: float, warps: int | None = None
) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta) * weight) for x [rows, n] and a split-K product's partials [split, rows, n];
    ``warps`` overrides the launch's (benchmarks)."""
    split, rows, n = delta.parts.shape
    if x.shape != (rows, n):
        raise ValueError(f"residual {tuple(x.shape)} against partials of {rows} x {n}")
    x = x.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    if rows:
        block = 1 << (n - 1).bit_length()
        # splits loaded together: a power of two (tl.arange's rule) that divides the split count, within what one
        # program holds (a forced tile may split K in 3)
        group = min(split & -split, max(1, _REGISTER_FLOATS // block))
        # 16 warps: a lone program's loads in flight are its memory rate (H200, 4,096 wide, 4 splits: 2.1 us against
        # 2.9 on 4 warps and 3.0 for the sum pass and compiled norm apart; 8 splits 2.6 against 7.2 and 3.8;
        # `python -m benchmarks.kernels.split_norm_bench`)
        warps = warps or 16
        _kernel()[(rows,)](
            x, delta.parts, delta.bias if delta.bias is not None else weight, weight, total, out, rows, n, eps,
            SPLIT=split, GROUP=group, HAS_BIAS=delta.bias is not None, BLOCK=block, num_warps=warps,
            DELTA=SPLIT_DELTA, **pdl.launch(x.device),
        )  # fmt: skip
    return total, out


def rows_usable(x: Tensor, weight: Tensor, delta: Tensor | None = None) -> bool:
    """Whether ``add_rms_norm_rows`` / ``rms_norm_rows`` take these operands: the kernel is on and probed, and x (and
    the residual's delta) are rows of one dtype, the weight's too (a float32 weight on bf16 rows would make torch's
    norm float32), no wider than a program holds."""
    return (
        rows_available()
        and x.dim() == 2
        and x.shape[-1] <= MAX_WIDTH
        and weight.dtype == x.dtype
        and (delta is None or (delta.shape == x.shape and delta.dtype == x.dtype))
    )


def _rows_launch(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, warps: int | None) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    rows, n = x.shape
    total = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    if rows:
        block = 1 << (n - 1).bit_length()
        # 8 warps: at 4,096 wide the fastest or within 3% of it from 1 to 4,096 rows (H200, 1.18 / 1.67 / 4.55 /
        # 34.05 us at 1 / 64 / 512 / 4,096 rows; `python -m benchmarks.kernels.split_norm_bench --rows`)
        _kernel()[(rows,)](
            x, delta.contiguous() if delta is not None else x, weight, weight, total, out, rows, n, eps,
            SPLIT=1, GROUP=1, HAS_BIAS=False, BLOCK=block, num_warps=warps or (16 if block > 8192 else 8),
            DELTA=NO_DELTA if delta is None else DENSE_DELTA, **pdl.launch(x.device),
        )  # fmt: skip
    return total, out


def add_rms_norm_rows(
    x: Tensor, delta: Tensor, weight: Tensor, eps: float, warps: int | None = None
) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta) * weight) for rows x and delta [rows, n] of one dtype (``rows_usable``):
    ``RMSNorm.add``'s values, in one launch."""
    return _rows_launch(x, delta, weight, eps, warps)


def rms_norm_rows(x: Tensor, weight: Tensor, eps: float, warps: int | None = None) -> Tensor:
    """rms_norm(x) * weight for rows x [rows, n] (``rows_usable``): ``RMSNorm.forward``'s values, in one launch."""
    return _rows_launch(x, None, weight, eps, warps)[1]


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once against the sum pass and the eager add and norm; a Triton that cannot compile here or a
    wrong answer turns it off for the process (the projections then sum their own partials)."""
    gen = torch.Generator().manual_seed(0)
    parts = torch.randn(4, 3, 320, generator=gen).to(device=device)
    x = torch.randn(3, 320, generator=gen).to(device=device, dtype=dtype)
    weight = (1 + torch.randn(320, generator=gen) / 8).to(device=device, dtype=dtype)
    bias = torch.randn(320, generator=gen).to(device=device, dtype=dtype)

    def check() -> bool:
        delta = Partials(parts, bias, dtype)
        total, out = add_rms_norm(x, delta, weight, 1e-6)
        want_total = x + delta.settle()
        want = reference_norm(want_total, weight, 1e-6)
        return all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in ((total, want_total), (out, want)))

    return SWITCH.probe(check)


def probe_rows(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the plain-rows kernel (after a residual, and alone) once against the eager add and norm; a failure turns it
    off for the process and the compiled norm serves."""
    gen = torch.Generator().manual_seed(1)
    x, delta = (torch.randn(5, 320, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    weight = (1 + torch.randn(320, generator=gen) / 8).to(device=device, dtype=dtype)

    def check() -> bool:
        total, out = add_rms_norm_rows(x, delta, weight, 1e-6)
        want_total = x + delta
        pairs = ((total, want_total), (out, reference_norm(want_total, weight, 1e-6)),
                 (rms_norm_rows(x, weight, 1e-6), reference_norm(x, weight, 1e-6)))
        return all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in pairs)

    return ROWS_SWITCH.probe(check)


def reference_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm: float32 statistics, cast back before the weight multiply."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
