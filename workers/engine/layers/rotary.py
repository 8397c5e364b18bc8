"""Multimodal rotary position embedding (M-RoPE) for decoders: which position row (t, h or w) drives each rotary
frequency, the float32 angles of a batch's positions, and rotary applied to q or k.

The families turn the angles into cos / sin tables themselves, each in its reference's own op order (casting before
or after duplicating the halves, say), because that order decides the roundings that greedy equality with
transformers rests on.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def mrope_rows(section: tuple[int, ...], interleaved: bool) -> list[int]:
    """Per rotary frequency, the position row (0 = t, 1 = h, 2 = w) driving it. Contiguous (Qwen2-VL, Qwen2.5-VL):
    the first section[0] frequencies take t, the next section[1] h, the rest w. Interleaved (transformers'
    Qwen3-VL): all t, but frequency j goes to h if j % 3 == 1 and j < 3 * section[1], to w if j % 3 == 2 and
    j < 3 * section[2]."""
    if not interleaved:
        return [row for row, n in enumerate(section) for _ in range(n)]
    half = sum(section)
    rows = [0] * half
    for row in (1, 2):
        for j in range(row, min(3 * section[row], half), 3):
            rows[j] = row
    return rows


class MRopeAngles(nn.Module):
    """positions int64 [3, T] (or [T] for text only) -> float32 angles [T, head_dim / 2], once per forward for all
    layers. Each frequency's position row is picked with one gather, then multiplied: the same float32 products
    transformers forms before it recomposes its per-row tables."""

    def __init__(self, head_dim: int, theta: float, rows: list[int]) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.inv_freq: Tensor
        self.row_of_freq: Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("row_of_freq", torch.tensor(rows, dtype=torch.long), persistent=False)

    def angles(self, positions: Tensor) -> Tensor:
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        return positions[self.row_of_freq].t().float() * self.inv_freq.float()


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x [T, H, D]; cos and sign-folded sin [T, 1, D] (``cat(-sin_lo, sin_hi)``), in x's dtype.

    ``rotate_half(x) * sin`` equals ``swap_halves(x) * cat(-sin_lo, sin_hi)`` bit for bit (negation is exact and
    rounding is symmetric), so this is transformers' ``x * cos + rotate_half(x) * sin`` with its roundings, the
    negation done once per forward in the tables instead of in every layer."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * sin_signed
