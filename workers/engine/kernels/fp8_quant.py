"""FP8 (e4m3) quantization arithmetic shared by the loader, the demo writer and the FP8 GEMMs: the two weight
layouts published checkpoints use, and the dynamic activation scales the GEMMs take.

Scales are *dequantization* factors (real = fp8 * scale) in float32, as both formats store them:
* block (Qwen's ``-FP8`` repos, ``weight_scale_inv``; compressed-tensors ``strategy: block``): one scale per
  128 x 128 tile of the last two dims, ``[..., ceil(out/128), ceil(in/128)]``;
* channel (compressed-tensors ``strategy: channel``, ``weight_scale``): one per output row, ``[..., out, 1]``;
* row blocks (glimpse's own, for fused tensor-parallel layers whose sub-projections do not start on a 128-row
  boundary): one per row and 128 columns, ``[out, ceil(in/128)]`` (models/fp8_layers.py).
Everything here is plain torch and runs on any device; it is the CPU reference the CUDA kernels are held to.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = 128
# A zero block or row still needs a finite scale: dividing by it must not make NaNs (0 / tiny = 0).
_MIN_SCALE = 1e-12


def expand_scale(scale: Tensor, shape: torch.Size | tuple[int, ...], block: int = BLOCK) -> Tensor:
    """Scales in any of the layouts (per ``block`` x ``block`` tile, per row and ``block`` columns, per row) as a
    float32 tensor that broadcasts over a weight of ``shape``; the layout is read from the scale's shape."""
    rows, cols = shape[-2], shape[-1]
    s = scale.float()
    if s.shape[-2] != rows:
        s = s.repeat_interleave(block, dim=-2)[..., :rows, :]
    if s.shape[-1] not in (1, cols):
        s = s.repeat_interleave(block, dim=-1)[..., :cols]
    return s


def dequantize(weight: Tensor, scale: Tensor) -> Tensor:
    """An FP8 weight with its scales -> float32 (one rounding: fp8 -> f32 is exact). The scales are one per
    128 x 128 tile of the last two dims, one per row and 128 columns, or one per row ([..., rows, 1])."""
    w = weight.float()
    return w * expand_scale(scale, w.shape)


def quantize_with(weight: Tensor, scale: Tensor, block: int = BLOCK) -> Tensor:
    """``weight``'s e4m3 values under the given dequantization scales (any layout ``expand_scale`` reads); for a
    weight dequantized with those scales, the values it was made from."""
    w = weight.float()
    return (w / expand_scale(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_block(weight: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Quantize the last two dims in ``block`` x ``block`` tiles, each tile's absolute max to 448 (how Qwen's
    FP8 repos are made): (fp8 weight, float32 scales [..., ceil(R/b), ceil(C/b)])."""
    w = weight.float()
    *lead, rows, cols = w.shape
    pr, pc = -rows % block, -cols % block
    padded = torch.nn.functional.pad(w, (0, pc, 0, pr))
    tiles = padded.reshape(*lead, (rows + pr) // block, block, (cols + pc) // block, block)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    return quantize_with(w, scale, block), scale


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize each row (output channel) of the last dim, its absolute max to 448: (fp8, float32 [..., rows, 1])."""
    w = weight.float()
    scale = (w.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token activation quantization: x [M, K] -> (fp8 [M, K], float32 scales [M, 1])."""
    return quantize_rows(x)


def quantize_token_groups(x: Tensor, group: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Dynamic per-token-group (1 x ``group``) activation quantization, K a multiple of ``group``:
    x [M, K] -> (fp8 [M, K], float32 scales [M, K / group])."""
    m, k = x.shape
    q, scale = quantize_rows(x.reshape(m, k // group, group))
    return q.reshape(m, k), scale.squeeze(-1)


def is_block(weight: Tensor, scale: Tensor) -> bool:
    """Whether an expert stack's scales [E, *, ceil(K/128)] are 128-column blocks (per 128 x 128 tile, or per row
    and 128 columns where a shard's rows do not keep the checkpoint's tiles whole), not one per row ([E, N, 1])."""
    e, n, k = weight.shape
    return scale.dim() == 3 and scale.shape[0] == e and scale.shape[2] == -(-k // BLOCK) and (
        scale.shape[1] in (n, -(-n // BLOCK))) and not (scale.shape[1] == n and scale.shape[2] == 1)
