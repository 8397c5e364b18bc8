"""FP8 GEMMs of the language model's linear layers and routed experts: the one place that picks how an FP8
weight is multiplied, so each variant can be measured on the GPU (benchmarks/kernels/fp8_gemm_bench.py).

Variants (``GLIMPSE_FP8_GEMM``, read once per process):
* ``auto`` (default, by measurement; the CPU has no FP8 layers either way): the Qwen3-VL-8B shape served from its
  block-FP8 checkpoint on an H200 (``benchmarks/serving/fp8_bench.py``, session 36) against the bf16 checkpoint:
  batch-1 TPOT 2.79 ms against 3.55, (b) 7.96 req/s against 7.65, (a) TTFT 1,054 ms against 1,108, weights 9.9 GiB
  against 16.3 (until session 36 every FP8 variant lost to bf16 at decode, and ``bf16`` was the default). It runs,
  at most W8A16_MAX_ROWS rows (decode), the decode Triton kernel (w8a16_gemm.py: FP8 weights read as
  they are, the activations quantized per 1 x 128 group inside the kernel, no quantization kernels); above that the native kernel where torch has
  one for the device and the weight's scales, else ``dequant``. Channel scales: ``torch._scaled_mm`` row-wise
  (activations quantized per token). 128 x 128 block scales: ``F.scaled_mm`` BlockWise1x128 x BlockWise128x128
  (activations quantized per 1 x 128 token group; cuBLAS on Hopper; on CUDA that quantization is one Triton kernel,
  fp8_act_quant.py, in CUDA graphs too). Otherwise, from COMPILED_QUANT_MIN_ROWS rows the
  activations' quantization is one compiled kernel: at 8,192 rows it took block qkv from 0.784 to 0.365 ms (bf16
  0.516) and row-wise down from 1.794 to 0.795 (bf16 1.011) on an H200 (``fp8_gemm_bench --eager``, session 35). Routed experts: ``torch._scaled_grouped_mm``
  row-wise (at decode rows moe_kernel.py's Triton kernels, which read the FP8 stacks weight-only). The 64-row threshold: measured below (W8A16_MAX_ROWS).
* ``bf16``: no FP8 layer at all: the loader's dequantized weights stay as they are (the CPU path everywhere).
* ``w8a16``: the decode Triton kernel at every row count (prefill chunks too, tiled along M): what the
  benchmark compares at every M (weight-only when its tile mode is DOT: ``GLIMPSE_W8A16_TILE``). Routed experts stay in the model dtype (the
  grouped FP8 GEMM quantizes activations); a weight whose kernel fails falls back to ``dequant``.
* ``dequant``: FP8 weights in memory, each call dequantizes the weight to the activation dtype and runs the
  bf16 GEMM (half the weight memory, no FP8 tensor cores).
Routed experts of a 128 x 128 block checkpoint stay FP8 with the checkpoint's tiles: fp8_grouped_block.py's Triton
grouped GEMM at prefill rows (torch's grouped FP8 GEMM has no block-scaled recipe on Hopper), moe_kernel.py's at
decode rows. ``GLIMPSE_FP8_BLOCK_EXPERTS=rowwise`` re-quantizes them per row for torch's row-wise grouped GEMM
instead (one scale per row over the whole K, coarser than the checkpoint's tiles: on the demo checkpoints it changes
greedy tokens) and ``=bf16`` dequantizes them.
Each native kernel (and w8a16) is probed once per process on a small problem against the dequantized GEMM (``probe``: it
must not raise and must compute the same product; for the block recipes this also settles how the weight scales are
laid out). A kernel that fails its probe, or raises later for one shape, is not used again (for that shape): those
calls take ``dequant``, with one warning.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.engine.kernels import fp8_act_quant, fp8_grouped_block, fused, skinny_gemm, w8a16_gemm
from workers.engine.kernels.fp8_quant import (
    BLOCK,
    dequantize,
    is_block,
    quantize_block,
    quantize_rows,
    quantize_tokens,
)

log = logging.getLogger("glimpse.fp8")

Variant = Literal["auto", "w8a16", "dequant", "bf16"]
VARIANTS: tuple[Variant, ...] = ("auto", "w8a16", "dequant", "bf16")
VARIANT_ENV = "GLIMPSE_FP8_GEMM"
_refused: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()  # (kernel, weight shape, scale shape)
# Rows up to which ``auto`` takes the decode kernel: decode batches, where the weights' stream is the cost. At 32
# and 64 rows the Qwen3-VL-8B shape's four projections took 0.099 and 0.106 ms in it against 0.172 and 0.183 in
# cuBLAS's block-scaled GEMM with its activation quantization (bf16: 0.115, 0.116; H200, fp8_gemm_bench, graph-
# replayed, 2026-12-02); above 64 rows it is not measured. GLIMPSE_W8A16_MAX_ROWS (read at import) moves it.
W8A16_MAX_ROWS = int(os.environ.get("GLIMPSE_W8A16_MAX_ROWS", "64"))
# Rows from which the activations' quantization runs as one compiled kernel (fused.py) instead of torch's six or seven
# ops with float32 copies between them. Below it the eager ops stay: a symbolic-rows graph from torch.compile covers
# every count from 2 up, but a count of 1 would compile a graph of its own at serving time.
COMPILED_QUANT_MIN_ROWS = 32


def _quantize(fn: Callable[[Tensor], tuple[Tensor, Tensor]], x: Tensor) -> tuple[Tensor, Tensor]:
    """``fn(x)``, an activation quantization, as its compiled kernel on CUDA from COMPILED_QUANT_MIN_ROWS rows and
    outside a CUDA-graph capture (nothing may compile there; the captured steps are small ones)."""
    if x.is_cuda and x.shape[0] >= COMPILED_QUANT_MIN_ROWS and not torch.cuda.is_current_stream_capturing():
        out: tuple[Tensor, Tensor] = fused.compiled(fn)(x)
        return out
    return fn(x)


def fp8_block_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """``quantize_token_groups(x, BLOCK)`` with the scales laid out as cuBLAS's block-scaled GEMM takes them
    (token-major: [M, K / 128] with stride (1, M))."""
    return fp8_act_quant.torch_ops(x)


def block_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """``fp8_block_activations(x)``: on CUDA one Triton kernel (fp8_act_quant.py: the same bits, in CUDA graphs
    too), else (or with it off) torch's ops."""
    if x.is_cuda and fp8_act_quant.available():
        return fp8_act_quant.quantize(x)
    return _quantize(fp8_block_activations, x)


def variant() -> Variant:
    value = os.environ.get(VARIANT_ENV, "auto")
    for v in VARIANTS:
        if value == v:
            return v
    raise ValueError(f"{VARIANT_ENV}={value!r}: choose one of {', '.join(VARIANTS)}")


BLOCK_EXPERTS_ENV = "GLIMPSE_FP8_BLOCK_EXPERTS"
BlockExperts = Literal["block", "rowwise", "bf16"]


def block_experts() -> BlockExperts:
    """How a block checkpoint's routed experts are held (``GLIMPSE_FP8_BLOCK_EXPERTS``): FP8 with the checkpoint's
    tiles (``block``, the default), re-quantized per row (``rowwise``) or dequantized (``bf16``)."""
    value = os.environ.get(BLOCK_EXPERTS_ENV, "block")
    for mode in ("block", "rowwise", "bf16"):
        if value == mode:
            return mode
    raise ValueError(f"{BLOCK_EXPERTS_ENV}={value!r}: choose block, rowwise or bf16")


@functools.cache
def device_supports_fp8(device: torch.device) -> bool:
    """FP8 tensor cores: SM89 (Ada) and SM90+ (Hopper, Blackwell). Elsewhere FP8 layers would only save memory
    and ``bf16`` keeps the weights dequantized."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def wants_fp8_layers(device: torch.device) -> bool:
    """Whether the loader should turn the checkpoint's FP8 layers into FP8 parameters on ``device``."""
    return variant() != "bf16" and device_supports_fp8(device)


ScaleKind = Literal["channel", "block", "row-block"]


def scale_kind(weight: Tensor, scale: Tensor) -> ScaleKind:
    """How a weight [N, K]'s scales are laid out: ``channel`` [N, 1] (also a row-block scale when K <= 128),
    ``block`` 128 x 128 tiles [ceil(N/128), ceil(K/128)], ``row-block`` one per row and 128 columns [N, ceil(K/128)]."""
    n = weight.shape[-2]
    if scale.shape[-1] == 1 and scale.shape[-2] == n:
        return "channel"
    return "row-block" if scale.shape[-2] == n and n > 1 else "block"


def dequant_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """The reference: the weight dequantized to x's dtype, then the plain GEMM."""
    return F.linear(x, dequantize(weight, scale).to(x.dtype), bias)


def rowwise_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] quantized per token, weight [N, K] fp8 with per-row scales [N, 1]: one ``torch._scaled_mm``."""
    q, sx = _quantize(quantize_tokens, x)
    out: Tensor = torch._scaled_mm(
        q, weight.t(), scale_a=sx, scale_b=scale.reshape(1, -1).float(), bias=bias, out_dtype=x.dtype
    )
    return out


# How the weight's block scales are handed to F.scaled_mm: torch's docs do not pin the layout per recipe, so each
# candidate is tried by ``probe`` on the first use of a recipe and the first that computes the right product is kept.
_B_SCALE_LAYOUTS: tuple[Callable[[Tensor], Tensor], ...] = (
    lambda s: s.t(),  # [K blocks, N blocks or rows], K-blocks contiguous (the 128 x 128 layout torch's tests use)
    lambda s: s.t().contiguous(),  # the same shape, N contiguous
    lambda s: s.t().contiguous().t(),  # [N, K blocks], N contiguous (how the activations' 1 x 128 scales go)
    lambda s: s,  # [N, K blocks] as stored
)
_chosen_layout: dict[str, int] = {}  # recipe ("block" / "row-block") -> index into _B_SCALE_LAYOUTS
_probed: dict[str, bool] = {}  # kernel kind -> whether its probe passed
_TRITON_KERNELS = {"w8a16": w8a16_gemm, "grouped-block": fp8_grouped_block}


def block_linear(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None, layout: int | None = None
) -> Tensor:
    """x [M, K] quantized per 1 x 128 group, weight [N, K] fp8 with 128 x 128 block scales (or row-block scales,
    recipe BlockWise1x128 for both operands): cuBLAS's block-scaled GEMM through ``F.scaled_mm``. cuBLAS takes the
    activation scales token-major with M a multiple of 4 (rows are zero-padded) and, for 128 x 128 tiles, the
    weight's K blocks padded to a multiple of 4. ``layout``: which of ``_B_SCALE_LAYOUTS`` (default: the one the probe chose)."""
    m = x.shape[0]
    q, sx = block_activations(F.pad(x, (0, 0, 0, -m % 4)) if m % 4 else x)
    out = block_mm(q, sx, weight, scale, x.dtype, layout)[:m]
    return out if bias is None else out + bias


def block_mm(
    q: Tensor, sx: Tensor, weight: Tensor, scale: Tensor, dtype: torch.dtype, layout: int | None = None
) -> Tensor:
    """``block_linear``'s GEMM alone, on activations already quantized (``block_activations`` of x, its rows
    padded to a multiple of 4): what fp8_gemm_bench times apart from the quantization."""
    kind = scale_kind(weight, scale)
    kb = scale.shape[1]
    # 128 x 128 scales go in with their K blocks padded to a multiple of 4; row-block (1 x 128) ones as they are
    # (torch 2.11 refuses a padded [N, 4] for K = 256: "scale_b must have shape 256 x 2").
    sw = F.pad(scale.float(), (0, -kb % 4)) if kb % 4 and kind == "block" else scale.float()
    arrange = _B_SCALE_LAYOUTS[_chosen_layout.get(kind, 0) if layout is None else layout]
    out: Tensor = F.scaled_mm(
        q,
        weight.t(),
        sx,
        F.ScalingType.BlockWise1x128,
        arrange(sw),
        F.ScalingType.BlockWise128x128 if kind == "block" else F.ScalingType.BlockWise1x128,
        output_dtype=dtype,
    )
    return out


def _close(got: Tensor, ref: Tensor) -> bool:
    """Within FP8 activation error of the dequantized product (a wrong scale layout is off by far more)."""
    err = (got.float() - ref.float()).pow(2).mean().sqrt()
    return bool(err <= 0.05 * ref.float().pow(2).mean().sqrt())


def probe(kind: str, device: torch.device) -> bool:
    """Run kernel ``kind`` ("rowwise", "block", "row-block", "grouped", "w8a16", "grouped-block") once on a small problem against the
    dequantized bf16 GEMM; a kernel that raises or computes something else is never used (one warning). For the block
    recipes this also picks the weight-scale layout. Not run inside a CUDA graph capture (the call there dequantizes)."""
    if kind in _probed:
        return _probed[kind]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    if kind in _TRITON_KERNELS:  # their own switches (GLIMPSE_TRITON_W8A16=0, ...); warn here like the others
        module = _TRITON_KERNELS[kind]
        ok = module.probe(device, torch.bfloat16)
        if not ok:
            log.warning("FP8 %s GEMM unusable on %s (%s): dequantized bf16 weights instead", kind, device,
                        module.SWITCH.why_off())
        _probed[kind] = ok
        return ok
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(8, 256, device=device, generator=gen).to(torch.bfloat16)
    w = torch.randn(2, 256, 256, device=device, generator=gen)
    ok, why = False, "wrong result"
    try:
        if kind == "grouped":
            q, s = quantize_rows(w)
            offs = torch.tensor([3, 8], dtype=torch.int32, device=device)
            ok = _close(grouped_mm(x, q, s, offs), grouped_reference(x, q, s, offs))
        elif kind == "rowwise":
            q, s = quantize_rows(w[0])
            ok = _close(rowwise_linear(x, q, s), dequant_linear(x, q, s))
        else:
            if device.type == "cuda" and not fp8_act_quant.probe(device, torch.bfloat16):  # torch's ops instead
                log.warning("the Triton FP8 activation quantization is off (%s)", fp8_act_quant.SWITCH.why_off())
            q, s = quantize_block(w[0])
            if kind == "row-block":
                s = s.repeat_interleave(BLOCK, dim=0)
            for i in range(len(_B_SCALE_LAYOUTS)):
                try:
                    ok = _close(block_linear(x, q, s, layout=i), dequant_linear(x, q, s))
                except (RuntimeError, ValueError) as exc:
                    why = str(exc).splitlines()[0]
                if ok:
                    _chosen_layout[kind] = i
                    break
    except (RuntimeError, ValueError) as exc:
        why = str(exc).splitlines()[0]
    if not ok:
        log.warning("FP8 %s GEMM unusable on %s (%s): that layout's weights use the dequantized bf16 GEMM", kind, device, why)
    _probed[kind] = ok
    return ok


def native_kernel(x: Tensor, weight: Tensor, scale: Tensor) -> str | None:
    """The scaled-FP8 kernel ``auto`` has for these operands ("rowwise", "block" or "row-block"), or None
    (dequant)."""
    if variant() != "auto" or not x.is_cuda or not device_supports_fp8(x.device):
        return None
    n, k = weight.shape
    kind = scale_kind(weight, scale)
    if kind == "channel":
        kernel = "rowwise" if k % 16 == 0 and n % 16 == 0 and x.dtype == torch.bfloat16 else None
    else:  # both block layouts: cuBLAS's block-scaled GEMM on Hopper and newer, K in whole 128-blocks
        hopper = torch.cuda.get_device_capability(x.device) >= (9, 0)
        kernel = kind if k % BLOCK == 0 and n % 16 == 0 and hopper and x.dtype == torch.bfloat16 else None
    if kernel is None or (kernel, tuple(weight.shape), tuple(scale.shape)) in _refused:
        return None
    return kernel if probe(kernel, x.device) else None


def wants_w8a16(v: Variant, rows: int) -> bool:
    """Whether variant ``v`` sends ``rows`` rows to the weight-only kernel (before asking if it can run)."""
    return v == "w8a16" or (v == "auto" and rows <= W8A16_MAX_ROWS)


def w8a16_usable(x: Tensor, weight: Tensor, scale: Tensor) -> bool:
    """Whether the weight-only kernel may run these operands: CUDA, bf16/fp16 activations, its probe passed, and
    this weight not refused before."""
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and ("w8a16", tuple(weight.shape), tuple(scale.shape)) not in _refused
        and probe("w8a16", x.device)
    )


def kernel_for(x: Tensor, weight: Tensor, scale: Tensor) -> str | None:
    """The kernel ``linear`` runs for x [M, K]: "w8a16", a ``native_kernel``, or None (dequant)."""
    if wants_w8a16(variant(), x.shape[0]) and w8a16_usable(x, weight, scale):
        return "w8a16"
    return native_kernel(x, weight, scale)


def linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x W^T + b for an FP8 weight [N, K] with its scales (any ``scale_kind``); x [..., K] in bf16/fp16."""
    lead = x.shape[:-1]
    y = skinny_gemm.settled(unsummed(x.reshape(-1, x.shape[-1]), weight, scale, bias))
    return y.reshape(*lead, y.shape[-1])


def unsummed(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor | skinny_gemm.Partials:
    """``linear`` for x [M, K], but a decode kernel's split-K partials left unsummed (skinny_gemm.Partials)."""
    kernel = kernel_for(x, weight, scale)
    if kernel is not None:
        try:
            if kernel == "w8a16":
                return w8a16_gemm.unsummed(x, weight, scale, bias)
            if kernel == "rowwise":
                return rowwise_linear(x, weight, scale, bias)
            return block_linear(x, weight, scale, bias)
        except Exception as exc:  # noqa: BLE001 - a layout or size this build refuses (Triton's compile and
            # resource errors are no RuntimeError): tried once, then dequant
            _refused.add((kernel, tuple(weight.shape), tuple(scale.shape)))
            log.warning("FP8 %s GEMM refused weight %s (%s); using dequantized bf16 GEMM", kernel, tuple(weight.shape), exc)
    return dequant_linear(x, weight, scale, bias)


def grouped_usable(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> bool:
    """Whether ``grouped_mm`` can run the routed experts ``weight`` [E, N, K] (FP8, or about to be) with ``scale``:
    CUDA FP8 hardware, and for block scales (fp8_quant.is_block) fp8_grouped_block.py's kernel, else bf16
    activations and strides cuBLAS takes (K and N multiples of 16)."""
    if not (variant() == "auto" and x.is_cuda and device_supports_fp8(x.device)):
        return False
    if scale is not None and is_block(weight, scale):
        return x.dtype in (torch.bfloat16, torch.float16) and probe("grouped-block", x.device)
    return (
        x.dtype == torch.bfloat16
        and hasattr(torch, "_scaled_grouped_mm")
        and weight.shape[-1] % 16 == 0
        and weight.shape[-2] % 16 == 0
        and probe("grouped", x.device)
    )


def grouped_mm(rows: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
    """rows [R, K] (grouped by expert, group ends ``offs``) times each expert's fp8 weight [E, N, K] with per-row
    scales [E, N, 1]: ``torch._scaled_grouped_mm`` row-wise, activations quantized per token; with block scales
    fp8_grouped_block.py's kernel."""
    if is_block(weight, scale):
        return fp8_grouped_block.grouped_mm(rows, weight, scale, offs)
    q, sx = _quantize(quantize_tokens, rows)
    out: Tensor = torch._scaled_grouped_mm(
        q,
        weight.transpose(1, 2),
        sx.reshape(-1),
        scale.reshape(scale.shape[0], -1).float(),
        offs=offs,
        out_dtype=rows.dtype,
    )
    return out


def grouped_reference(rows: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
    """``grouped_mm`` with the weights dequantized: one F.linear per expert's rows (any device)."""
    out = rows.new_zeros(rows.shape[0], weight.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            w = dequantize(weight[e], scale[e]).to(rows.dtype)
            out[start:end] = F.linear(rows[start:end], w)
        start = end
    return out
