"""What the vision-tower tests of every Qwen-style family share."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def encode_one_by_one(tower: nn.Module, pixels: Tensor, grids: Sequence[tuple[int, int, int]]) -> Tensor:
    """Each image of a packed call encoded alone, the outputs concatenated in call order: what a packed call must
    equal (the embedding cache stores row slices of packed outputs as each image's own)."""
    alone, start = [], 0
    with torch.no_grad():
        for g in grids:
            n = g[0] * g[1] * g[2]
            alone.append(tower(pixels[start : start + n], [g]))
            start += n
    return torch.cat(alone)
