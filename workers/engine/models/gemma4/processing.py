"""Gemma 4's image side of a prompt, for MMProcessor (workers/engine/prompt/processor.py) through the family's
``images`` hook: an image's patch rows and grid at a token budget, its grid from its size alone, and the ids that wrap
each image's span.

Gemma 4 gives each image a budget of soft tokens (``max_soft_tokens``: 70, 140, 280, 560 or 1120; the checkpoint's
processor names its default): the image is resized, aspect kept, to the largest size whose 16-px patches fit
``budget * 9`` and whose sides are multiples of 48 px (16-px patches pooled 3 x 3), then rescaled to [0, 1] (no
normalisation: the tower maps [0, 1] to [-1, 1] itself). The processor pads every image's rows to ``budget * 9``; the
tower (vision.py) takes the real rows alone, so the padding is cut here. In the prompt an image is ``<|image>``, its
soft tokens, ``<image|>`` (transformers' ``Gemma4Processor.replace_image_token``).

The rows come from the processor's own steps taken directly (``fast_rows``): the same torchvision resize of the uint8
image, then the patchify and the rescale written once into the rows, where the processor converts a PIL image to a
tensor, rescales a float copy, patchifies another, pads to the budget and stacks a third. A 1080p JPEG's rows at the
default budget took 87 ms through the processor (its PIL conversion 21, rescale 24, padding 27) on the 2-core box,
on a fresh image's time to first token. The bits are the processor's: checked on test images when the class is built
(``fast_matches``), and a processor configured otherwise (another resample, a normalisation) keeps its own call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torchvision.transforms.v2.functional as tvF
from PIL import Image
from torch import Tensor
from transformers.image_utils import PILImageResampling
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
        self.rescale = float(ip.rescale_factor)
        self.fast = self.fast_matches()

    def grid(self, width: int, height: int, budget: int) -> Grid:
        """The (1, h, w) patch grid of an image of this size at ``budget``, by the processor's own arithmetic (no
        pixels). Raises ValueError where the processor refuses the size (e.g. a sliver that rounds to 0 x 0)."""
        h, w = get_aspect_ratio_preserving_size(
            height=height, width=width, patch_size=self.patch, max_patches=budget * self.pooling**2,
            pooling_kernel_size=self.pooling,
        )
        return 1, h // self.patch, w // self.patch

    def rows(self, image: Image.Image | np.ndarray, budget: int) -> tuple[Tensor, Grid]:
        """The image's patch rows at ``budget`` ([h * w, 3 * patch**2] float32, row-major over the grid, each row
        (y, x, channel) as transformers' convert_image_to_patches lays it out) and its (1, h, w) grid. ``image``: RGB,
        a PIL image or [H, W, 3] uint8 pixels (`decode_pixels`)."""
        if self.fast:
            return self.fast_rows(np.asarray(image), budget)
        return self.processor_rows(image if isinstance(image, Image.Image) else Image.fromarray(image, "RGB"), budget)

    def fast_rows(self, pixels: np.ndarray, budget: int) -> tuple[Tensor, Grid]:
        """``rows`` from [H, W, 3] uint8 RGB pixels by the processor's steps (module docstring)."""
        height, width = pixels.shape[:2]
        grid = self.grid(width, height, budget)
        p, (_, gh, gw) = self.patch, grid
        # [3, H, W] contiguous, as the processor's PIL-to-tensor gives it: the resize then takes the same kernel.
        planes = np.ascontiguousarray(pixels.transpose(2, 0, 1))
        # (A PIL image's array is read-only; torch wants a writable one, and a degenerate transpose copies nothing.)
        chw = torch.from_numpy(planes if planes.flags.writeable else planes.copy())
        if (gh * p, gw * p) != (height, width):
            chw = tvF.resize(chw, [gh * p, gw * p], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        rows = torch.empty((gh * gw, p * p * 3), dtype=torch.float32)
        # convert_image_to_patches's [gh, gw, y, x, channel] order, widened to float32 in the same copy; then the
        # processor's ``image * rescale_factor`` in float32 (elementwise, so its order of work does not change a bit).
        rows.view(gh, gw, p, p, 3).copy_(chw.unflatten(2, (gw, p)).unflatten(1, (gh, p)).permute(1, 3, 2, 4, 0))
        return rows.mul_(self.rescale), grid

    def processor_rows(self, image: Image.Image, budget: int) -> tuple[Tensor, Grid]:
        """``rows`` through the processor's own call, with its padding rows cut."""
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

    def fast_matches(self) -> bool:
        """Whether ``fast_rows`` gives the processor's rows bit for bit here: its configuration is the one the fast
        path repeats, and on test images that are shrunk, enlarged and already at a grid size it computes the same
        bits (a transformers or torchvision that changed a step would show here, not in served answers)."""
        ip = self.image_processor
        if not (ip.do_resize and ip.do_rescale and not ip.do_normalize and ip.resample == PILImageResampling.BICUBIC):
            return False
        gen = np.random.default_rng(0)
        budget = min(self.budgets)
        _, gh, gw = self.grid(517, 301, budget)
        for height, width in ((301, 517), (29, 41), (gh * self.patch, gw * self.patch)):  # the last needs no resize
            pixels = gen.integers(0, 256, (height, width, 3), dtype=np.uint8)
            want, want_grid = self.processor_rows(Image.fromarray(pixels, "RGB"), budget)
            got, got_grid = self.fast_rows(pixels, budget)
            if got_grid != want_grid or not torch.equal(got, want):
                return False
        return True
