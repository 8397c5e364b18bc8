"""Gemma 4's image side of a prompt, for MMProcessor (workers/engine/prompt/processor.py) through the family's
``images`` hook: an image's patch rows and grid at a token budget, its grid from its size alone, and the ids that wrap
each image's span.

Gemma 4 gives each image a budget of soft tokens (``max_soft_tokens``: 70, 140, 280, 560 or 1120; the checkpoint's
processor names its default): the image is resized, aspect kept, to the largest size whose 16-px patches fit
``budget * 9`` and whose sides are multiples of 48 px (16-px patches pooled 3 x 3), then rescaled to [0, 1] (no
normalisation: the tower maps [0, 1] to [-1, 1] itself). The processor pads every image's rows to ``budget * 9``; the
tower (vision.py) takes the real rows alone, so the padding is cut here. In the prompt an image is ``<|image>``, its
soft tokens, ``<image|>`` (transformers' ``Gemma4Processor.replace_image_token``).

The processor's own steps are taken directly: the same torchvision resize of the uint8 image (``resized``), then the
rescale and the patchify written once into the rows (frame_layout.py ``FrameLayout`` in its "rows" order), where the
processor converts a PIL image to a tensor, rescales a float copy, patchifies another, pads to the budget and stacks
a third. A tokenizer writes the resized uint8 frame itself to shared memory (``frame``: half the bytes of bf16 rows,
and no float work), which the model worker makes into the same rows on its device. The resize reads the pixels as
decoded (channels-last) and, given MMProcessor's resize threads, runs its horizontal pass in row strips on them: a
decoded 1080p image took 42.7 ms through the processor and 10.3 as a frame on one thread, 5.7 in two strips, at the
default budget; 87.1, 27.7 and 7.9 at 1120 (2-core box, `python -m benchmarks.request_path.fresh_image_bench
--tokenizers 1`). The bits are the processor's: checked on test images when the class is built (``fast_matches``);
a processor configured otherwise (another resample, a normalisation) keeps its own call and rows.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from transformers.image_utils import PILImageResampling
from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size

from workers.engine.models.frame_layout import FrameLayout
from workers.engine.models.frame_resize import resize_in_strips
from workers.engine.models.model_spec import ModelSpec

# transformers' Gemma4ImageProcessor refuses any other max_soft_tokens.
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)

Grid = tuple[int, int, int]


def frame_layout_of(ip: Any, pooling: int) -> FrameLayout | None:
    """The uint8-frame layout of a Gemma 4 image processor configured as published (bicubic resize, a rescale, no
    normalisation), else None: the numbers a model worker needs to make a frame into rows (the family's
    ``frame_layout`` hook). Whether the tokenizer writes frames at all is ``Gemma4Images.fast``, checked on pixels."""
    if not (ip.do_resize and ip.do_rescale and not ip.do_normalize and ip.resample == PILImageResampling.BICUBIC):
        return None
    return FrameLayout(int(ip.patch_size), pooling, 1, (0.0,) * 3, (1.0,) * 3, order="rows",
                       scale=float(ip.rescale_factor))


class Gemma4Images:
    """The checkpoint's Gemma 4 image processor behind MMProcessor's family hook (``FamilyImages`` in processor.py)."""

    def __init__(self, hf_processor: Any, spec: ModelSpec, pool: Executor | None = None, strips: int = 1) -> None:
        ip = hf_processor.image_processor
        # The resize's horizontal pass in ``strips`` row strips on ``pool`` and the caller (resize_in_strips).
        self._pool, self._strips = pool, strips
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
        # The layout the configuration gives; served (``frame_layout``) only once it matched the processor's bits.
        self._configured = frame_layout_of(ip, self.pooling)
        self.frame_layout = self._configured if self.fast_matches() else None

    @property
    def fast(self) -> bool:
        """Whether images take the processor's steps directly (rows and frames), not the processor's own call."""
        return self.frame_layout is not None

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

    def frame(self, image: Image.Image | np.ndarray, budget: int) -> tuple[Tensor, Grid]:
        """The resized uint8 frame [H, W, 3] (contiguous: a segment's layout) the rows are cut from, and the grid;
        only where ``frame_layout`` is set."""
        chw, grid = self.resized(np.asarray(image), budget)
        return chw.permute(1, 2, 0).contiguous(), grid  # channels-last already: no copy

    def fast_rows(self, pixels: np.ndarray, budget: int) -> tuple[Tensor, Grid]:
        """``rows`` from [H, W, 3] uint8 RGB pixels by the processor's steps (module docstring)."""
        chw, grid = self.resized(pixels, budget)
        if self._configured is None:
            raise ValueError("this image processor's configuration has no fast path")
        return self._configured.rows(chw.permute(1, 2, 0), torch.float32), grid

    def resized(self, pixels: np.ndarray, budget: int) -> tuple[Tensor, Grid]:
        """The processor's resize of [H, W, 3] uint8 pixels to the grid at ``budget``: [3, H', W'] uint8 with
        channels-last strides. The processor resizes a [3, H, W] contiguous copy with torchvision; torch's uint8
        antialiased kernel works channels-last anyway, so it is given the pixels as decoded (no planar copy and
        back; the module docstring has the times); the bits are the processor's (``fast_matches``)."""
        height, width = pixels.shape[:2]
        grid = self.grid(width, height, budget)
        p, (_, gh, gw) = self.patch, grid
        # (A PIL image's array is read-only; torch wants a writable one.)
        hwc = torch.from_numpy(pixels if pixels.flags.writeable else pixels.copy())
        # (An image already at the grid's size comes back as it is, as from torchvision's resize.)
        chw = resize_in_strips(hwc.permute(2, 0, 1).unsqueeze(0), (gh * p, gw * p), self._pool, self._strips)[0]
        return chw, grid

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
        if self._configured is None:
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
