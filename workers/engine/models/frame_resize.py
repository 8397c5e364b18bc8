"""torch's antialiased bicubic resize of a uint8 image split over threads, with the bits of one call.

An image processor's resize of a fresh image sits on the critical path of its request (the tokenizer writes the
resized uint8 frame before the image's chunk can run), and torch's uint8 kernel runs on one thread whatever its
intra-op pool. Below the prompt room so a family's own image side (Gemma 4) can use it as the Qwen-style path does.
"""

from __future__ import annotations

from concurrent.futures import Executor

import torch
import torch.nn.functional as F
from torch import Tensor


def resize_in_strips(x: Tensor, size: tuple[int, int], pool: Executor | None, strips: int) -> Tensor:
    """torch's antialiased bicubic resize of a [1, C, H, W] channels-last uint8 image as the two passes its kernel
    makes anyway (horizontal into a uint8 intermediate, then vertical), the horizontal one in row strips run on
    ``pool`` and the calling thread (one call without a pool). Each row's horizontal pass reads only that row, so the strips give the
    one-call bits (its users check that on probe images: `frame_resizer`, `Gemma4Images.fast_matches`); the kernel
    itself runs on one thread whatever torch's pool."""
    _, c, h, w = x.shape
    if size == (h, w):
        return x  # as torchvision's resize does
    if pool is None or size[1] == w or strips < 2 or h < strips:
        return F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False)
    mid = torch.empty((1, c, h, size[1]), dtype=x.dtype, memory_format=torch.channels_last)
    bounds = [h * i // strips for i in range(strips + 1)]

    def rows(i: int) -> None:
        a, b = bounds[i], bounds[i + 1]  # rows of a channels-last tensor: the pass writes into ``mid`` in place
        torch.ops.aten._upsample_bicubic2d_aa.out(x[:, :, a:b], [b - a, size[1]], False, None, None, out=mid[:, :, a:b])

    others = [pool.submit(rows, i) for i in range(1, strips)]
    rows(0)
    for future in others:
        future.result()
    return mid if size[0] == h else F.interpolate(mid, size=size, mode="bicubic", antialias=True, align_corners=False)
