"""An image's pixels in shared memory as its resized uint8 frame, made into patch rows where they are read.

The Qwen-style image processors of transformers 5 resize an image in uint8, then rescale and normalise it in
float32 (one fused subtract and divide per channel), then cut the patch rows, repeating each frame over the
temporal patch. A tokenizer that writes the resized uint8 frame (3 x H x W bytes) instead of the rows in the model's
dtype (3 x 2 x 14 x 14 values a patch, at 2 bytes in bf16) writes a quarter of the bytes and does no float work:
6.3 instead of 25 MB for a 1080p image. The model worker repeats the processor's float32 math in the same order on
its own device, so the rows are the same bits; `frame_layout` checks that, byte for byte on a test image, before a
processor's images are written this way, and one that fails the check keeps the rows.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor


def patch_rows_into(frame: Tensor, dst: Tensor, patch: int, merge: int, temporal: int) -> None:
    """Lay a normalised [C, H, W] frame out as patch rows in ``dst`` ([t * h * w, C * temporal * patch**2], any
    float dtype): the processor's patchify, its temporal repeat and the cast in one strided copy."""
    c, h, w = frame.shape
    gh, gw = h // patch // merge, w // patch // merge
    src = frame.reshape(c, gh, merge, patch, gw, merge, patch).permute(1, 4, 2, 5, 0, 3, 6)  # [gh, gw, m, m, c, p, p]
    dst.view(gh, gw, merge, merge, c, temporal, patch, patch).copy_(
        src.unsqueeze(5).expand(gh, gw, merge, merge, c, temporal, patch, patch)
    )


@dataclass(frozen=True)
class FrameLayout:
    """How a uint8 frame becomes its patch rows: the geometry, and the mean and std fused with the rescale factor
    (float32 values, as the processor computes them)."""

    patch: int
    merge: int
    temporal: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def shape(self, grid: tuple[int, int, int]) -> tuple[int, int, int]:
        """The frame of an image of this (t, h, w) patch grid (t is 1: one image, repeated over the temporal patch)."""
        if grid[0] != 1:
            raise ValueError(f"a frame holds one image, not a temporal grid of {grid[0]}")
        return len(self.mean), grid[1] * self.patch, grid[2] * self.patch

    def rows(self, frame: Tensor, dtype: torch.dtype) -> Tensor:
        """[C, H, W] uint8, on any device -> its [h * w, row] patch rows in ``dtype``, on the same device."""
        mean, std = _constants(self, frame.device)
        normalised = frame.to(torch.float32).sub_(mean).div_(std)  # torchvision's normalize, in its order
        c, h, w = frame.shape
        out = torch.empty(
            (h // self.patch) * (w // self.patch), c * self.temporal * self.patch**2, dtype=dtype, device=frame.device
        )
        patch_rows_into(normalised, out, self.patch, self.merge, self.temporal)
        return out


@functools.lru_cache(maxsize=16)
def _constants(layout: FrameLayout, device: torch.device) -> tuple[Tensor, Tensor]:
    return tuple(  # type: ignore[return-value]
        torch.tensor(v, dtype=torch.float32, device=device).view(-1, 1, 1) for v in (layout.mean, layout.std)
    )


def probe_image() -> Image.Image:
    """The test image a processor's fast paths are checked on against its full path."""
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (61, 83, 3), dtype=np.uint8))


def unpatched_copy(ip: Any, normalise: bool) -> Any:
    """A copy of image processor ``ip`` that hands back the [C, H, W] frame instead of patch rows: normalised, or with
    ``normalise`` False the resized uint8 image as it is."""
    frames = copy.copy(ip)

    def unpatched(images: Tensor, patch_size: int, merge_size: int, temporal_patch_size: int) -> Any:
        return images, images.shape[-2] // patch_size, images.shape[-1] // patch_size

    def resized_only(images: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return images

    frames.patchify = unpatched
    if not normalise:
        frames.rescale_and_normalize = resized_only
    return frames


def layout_of(ip: Any, merge: int) -> FrameLayout | None:
    """The uint8-frame layout image processor ``ip``'s settings give (its geometry, its mean and std fused with the
    rescale factor), unchecked; None for a processor without the fused rescale-and-normalise step."""
    if not all(callable(getattr(ip, name, None)) for name in
               ("patchify", "rescale_and_normalize", "_fuse_mean_std_and_rescale_factor")):
        return None
    if not (ip.do_normalize and ip.do_rescale):
        return None
    mean, std, rescale_left = ip._fuse_mean_std_and_rescale_factor(
        do_normalize=ip.do_normalize, image_mean=ip.image_mean, image_std=ip.image_std,
        do_rescale=ip.do_rescale, rescale_factor=ip.rescale_factor, device=torch.device("cpu"),
    )
    if rescale_left:
        return None
    return FrameLayout(
        int(ip.patch_size), merge, int(getattr(ip, "temporal_patch_size", 1)),
        tuple(float(v) for v in torch.as_tensor(mean, dtype=torch.float32).flatten()),
        tuple(float(v) for v in torch.as_tensor(std, dtype=torch.float32).flatten()),
    )


def frame_layout(ip: Any, merge: int) -> tuple[FrameLayout, Any] | None:
    """The uint8-frame layout of image processor ``ip`` and a copy of ``ip`` that returns the resized uint8 frame,
    or None where its rows do not come out the same bits that way (another processor design, or settings that do
    not rescale and normalise)."""
    try:
        layout = layout_of(ip, merge)
        if layout is None:
            return None
        frames = unpatched_copy(ip, normalise=False)
        want = ip(images=[probe_image()], return_tensors="pt")
        got = frames(images=[probe_image()], return_tensors="pt")
        frame = got["pixel_values"]
        same = (
            frame.dtype == torch.uint8
            and frame.dim() == 3
            and torch.equal(want["image_grid_thw"], got["image_grid_thw"])
            and torch.equal(layout.rows(frame, torch.float32), want["pixel_values"].to(torch.float32))
        )
    except Exception:  # another processor design: its rows it is
        return None
    return (layout, frames) if same else None
