"""Gemma 4's image side of a prompt, for MMProcessor (workers/engine/prompt/processor.py) through the family's
``images`` hook: an image's patch rows and grid at a token budget, its grid from its size alone, and the ids that wrap
each image's span.

Gemma 4 gives each image a budget of soft tokens (``max_soft_tokens``: 70, 140, 280, 560 or 1120; the checkpoint's
processor names its default): the image is resized, aspect kept, to the largest size whose 16-px patches fit
``budget * 9`` and whose sides are multiples of 48 px (16-px patches pooled 3 x 3), then rescaled to [0, 1] (no
normalisation: the tower maps [0, 1] to [-1, 1] itself). The processor pads every image's rows to ``budget * 9``; the
tower (vision.py) takes the real rows alone, so the padding is cut here. In the prompt an image is ``<|image>``, its
soft tokens, ``<image|>`` (transformers' ``Gemma4Processor.replace_image_token``).
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image
from torch import Tensor
from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size

from workers.engine.models.base import ModelSpec

# transformers' Gemma4ImageProcessor refuses any other max_soft_tokens.
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)

Grid = tuple[int, int, int]


class Gemma4Images:
    """The checkpoint's Gemma 4 image processor behind MMProcessor's family hook (``FamilyImages`` in processor.py)."""

    def __init__(self, hf_processor: Any, spec: ModelSpec) -> None:
        ip = hf_processor.image_processor
        self.image_processor = ip
        self.patch = int(ip.patch_size)
        self.pooling = int(ip.pooling_kernel_size)
        if self.pooling != spec.spatial_merge_size:
            raise ValueError(
                f"the image processor pools {self.pooling} x {self.pooling} patches, the vision tower "
                f"{spec.spatial_merge_size} x {spec.spatial_merge_size}"
            )
        self.budgets: tuple[int, ...] = SOFT_TOKEN_BUDGETS
        self.default_budget = int(ip.max_soft_tokens)
        tokenizer = hf_processor.tokenizer
        # The processor's own strings, as replace_image_token writes them around the soft tokens.
        self.wrap: tuple[int, int] = (
            int(tokenizer.convert_tokens_to_ids(hf_processor.boi_token)),
            int(tokenizer.convert_tokens_to_ids(hf_processor.eoi_token)),
        )

    def grid(self, width: int, height: int, budget: int) -> Grid:
        """The (1, h, w) patch grid of an image of this size at ``budget``, by the processor's own arithmetic (no
        pixels). Raises ValueError where the processor refuses the size (e.g. a sliver that rounds to 0 x 0)."""
        h, w = get_aspect_ratio_preserving_size(
            height=height, width=width, patch_size=self.patch, max_patches=budget * self.pooling**2,
            pooling_kernel_size=self.pooling,
        )
        return 1, h // self.patch, w // self.patch

    def rows(self, image: Image.Image, budget: int) -> tuple[Tensor, Grid]:
        """The image's patch rows at ``budget`` ([h * w, 3 * patch**2] float32, row-major over the grid, each row
        (y, x, channel) as transformers' convert_image_to_patches lays it out) and its (1, h, w) grid: the processor's
        own output with its padding rows cut."""
        out = self.image_processor(images=[image], max_soft_tokens=budget, return_tensors="pt")
        positions = out["image_position_ids"][0]  # [budget * 9, 2] (x, y) per row; padding rows are -1
        real = positions[:, 0] >= 0
        n = int(real.sum())
        # The real rows come first, in row-major order (the processor pads after them).
        if n == 0 or not bool(real[:n].all()):
            raise ValueError("the image processor's padding rows are not all after its real rows")
        h, w = int(positions[:n, 1].max()) + 1, int(positions[:n, 0].max()) + 1
        if h * w != n:
            raise ValueError(f"the image processor gave {n} rows for a {h} x {w} patch grid")
        # A copy: a view would keep the whole padded batch alive for as long as the rows wait for shm.
        rows = out["pixel_values"][0, :n].to(torch.float32, copy=True)
        return rows, (1, h, w)
