"""What a prompt knows of its images and what processing one gives: the pad values that stand in an image's span
(hash-derived, so two images never share a prefix), the spans, the processed pixels a segment holds, and the
interface of a family's own image side (``FamilyImages``). processor.py makes them; tokenizers, the offline Engine and
the caches read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from PIL import Image

from workers.engine.prompt.pixel_frames import FrameLayout, patch_rows_into

# Pad values live above any real vocabulary, so an image span can never look like text, and two
# different images never look like the same prefix. They fit in int32.
PAD_BASE = 1 << 30


def pad_value(image_hash: bytes) -> int:
    return PAD_BASE + int.from_bytes(image_hash[:4], "little") % PAD_BASE


Grid = tuple[int, int, int]


class FamilyImages(Protocol):
    """A family's own image side, for processors the Qwen-style path does not fit (the family's ``images`` hook makes
    one from the checkpoint's transformers processor and the spec). Images then carry a token budget: one of
    ``budgets``, ``default_budget`` unless a request asks for another."""

    budgets: tuple[int, ...]
    default_budget: int
    wrap: tuple[int, int] | None  # ids written before and after each image's span (None: the span alone)

    def grid(self, width: int, height: int, budget: int) -> Grid:
        """The patch grid of an image of this size (no pixels); ValueError where the processor refuses it."""
        ...

    def rows(self, image: Image.Image | np.ndarray, budget: int) -> tuple[torch.Tensor, Grid]:
        """An RGB image's patch rows (float32) and grid; a PIL image or [H, W, 3] uint8 pixels."""
        ...

    # Where set, what a tokenizer writes instead of rows: ``frame``'s resized uint8 image, made into the same rows on
    # the model worker's device by this layout (models/frame_layout.py). None: rows.
    frame_layout: FrameLayout | None

    def frame(self, image: Image.Image | np.ndarray, budget: int) -> tuple[torch.Tensor, Grid]:
        """An RGB image's resized uint8 frame [H, W, C] (contiguous) and grid."""
        ...


@dataclass(frozen=True)
class ProcessedImage:
    hash: bytes
    grid: tuple[int, int, int]  # (t, h, w) in patches
    num_tokens: int
    # [t * h * w, channels * temporal_patch * patch**2] float32; with ``frame`` set, the normalised [channels, H, W]
    # float32 image the rows are cut from (`write_rows` lays them out), or with ``uint8`` the [H, W, channels] frame.
    pixel_values: torch.Tensor
    frame: tuple[int, int, int] | None = None  # (patch, merge, temporal patch) of a frame's rows
    # The frame is the resized uint8 image, before rescale and normalise (pixel_frames.py): shm holds it as it is.
    uint8: bool = False

    def write_rows(self, dst: torch.Tensor) -> None:
        """Write what a segment holds of this image into ``dst``: the patch rows ([t * h * w, row], any float
        dtype), or with ``uint8`` the frame itself ([H, W, C] uint8). From a normalised frame, the patchify, the
        temporal repeat and the cast are one strided copy, with no float32 copy of the rows in between: the
        same values, in the same layout, as the processor's own patchify."""
        if self.frame is None or self.uint8:
            dst.copy_(self.pixel_values)
            return
        patch_rows_into(self.pixel_values, dst, *self.frame)


class ImageMeta(Protocol):
    """What a prompt needs to know of an image: no pixels (a tokenizer builds prompts before, or without,
    processing an image whose segment it reuses)."""

    @property
    def hash(self) -> bytes: ...
    @property
    def grid(self) -> tuple[int, int, int]: ...
    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class ImageInfo:
    hash: bytes
    grid: tuple[int, int, int]
    num_tokens: int


@dataclass(frozen=True)
class ImageSpan:
    hash: bytes
    offset: int
    length: int
    grid: tuple[int, int, int]
    frame: tuple[int, int] | None = None  # a video's frame group: (its index, its temporal M-RoPE offset)


@dataclass(frozen=True)
class Prompt:
    input_ids: list[int]  # image spans hold hash-derived pad values
    mrope_delta: int  # a decoded token at index p sits at position p + mrope_delta on every row
    spans: list[ImageSpan]
