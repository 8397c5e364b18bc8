"""An image's pixels in shared memory as its resized uint8 frame, made into patch rows where they are read.

The Qwen-style image processors of transformers 5 resize an image in uint8, then rescale and normalise it in
float32 (one fused subtract and divide per channel), then cut the patch rows, repeating each frame over the
temporal patch. A tokenizer that writes the resized uint8 frame (H x W x 3 bytes, channels-last as decoded) instead
of the rows in the model's dtype (3 x 2 x 14 x 14 values a patch, at 2 bytes in bf16) writes a quarter of the bytes
and does no float work: 6.3 instead of 25 MB for a 1080p image. The model worker repeats the processor's float32
math in the same order on its own device, so the rows are the same bits; `frame_layout` checks that, byte for byte
on a test image, before a processor's images are written this way, and one that fails the check keeps the rows.
`frame_resizer` skips the processor's input conversions where its resize alone gives the same frame.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from workers.engine.models.frame_layout import FrameLayout, patch_rows_into
from workers.engine.models.frame_resize import resize_in_strips


def probe_image(height: int = 61, width: int = 83) -> Image.Image:
    """The test image a processor's fast paths are checked on against its full path."""
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))


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


def normalised_frames(ip: Any, geometry: tuple[int, int, int]) -> Any:
    """A copy of image processor ``ip`` whose patchify hands back the normalised image (a Qwen2-VL-style processor of
    transformers 5: resize, rescale and normalise, then patchify) for `patch_rows_into` with ``geometry`` (patch,
    merge, temporal patch); None where that does not give the processor's own rows, byte for byte, on a test image."""
    if not callable(getattr(ip, "patchify", None)):
        return None
    frames, probe = unpatched_copy(ip, normalise=True), probe_image()
    try:
        want = ip(images=[probe], return_tensors="pt")
        got = frames(images=[probe], return_tensors="pt")
        rows = torch.empty_like(want["pixel_values"], dtype=torch.float32)
        patch_rows_into(got["pixel_values"].to(torch.float32), rows, *geometry)
    except Exception:  # another processor layout: the full path it is
        return None
    same = torch.equal(want["image_grid_thw"], got["image_grid_thw"]) and torch.equal(rows, want["pixel_values"])
    return frames if same else None


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
            and torch.equal(layout.rows(frame.permute(1, 2, 0), torch.float32), want["pixel_values"].to(torch.float32))
        )
    except Exception:  # another processor design: its rows it is
        return None
    return (layout, frames) if same else None


def frame_resizer(
    ip: Any, merge: int, frames: Any, pool: Executor | None = None, strips: int = 1,
    grid_of: Callable[[int, int], tuple[int, int, int] | None] | None = None,
) -> FrameResizer | None:
    """A function giving an RGB image's resized uint8 frame ([C, H, W] with channels-last strides) by the processor's
    own resize, without its input conversions (another RGB copy, a contiguous [C, H, W] copy): 5.6 against 23 ms for
    a 1080p image on the 2-core box, on the critical path of every request with a fresh image. The resize runs on the
    pixels as decoded, channels-last, which torch's antialiased uint8 kernel prefers anyway, and so does the segment
    (`FrameLayout.shape`). With a ``pool`` and ``grid_of`` (`MMProcessor.image_grid`: width, height -> the grid the
    processor resizes to), a bicubic resize runs its horizontal pass (most of its time) in ``strips`` row strips
    (`resize_in_strips`). None unless it gives ``frames``' (`frame_layout`'s copy of ``ip``)
    bits, byte for byte, on test images that are scaled up and down; the strips are dropped unless they give them
    too."""
    patch = int(ip.patch_size)

    def whole(pixels: Tensor) -> Tensor:
        return ip.resize(images=pixels.permute(2, 0, 1).unsqueeze(0), size=ip.size, resample=ip.resample,
                         factor=patch * merge)[0]

    def split(pixels: Tensor) -> Tensor:
        assert pool is not None and grid_of is not None
        grid = grid_of(pixels.shape[1], pixels.shape[0])
        if grid is None:
            return whole(pixels)
        size = (grid[1] * patch, grid[2] * patch)
        return resize_in_strips(pixels.permute(2, 0, 1).unsqueeze(0), size, pool, strips)[0]

    def pixels_of(image: Image.Image | np.ndarray) -> Tensor:
        # [H, W, C]: RGB pixels as decoded (`decode_pixels`), else a writable copy of the PIL image's
        return torch.from_numpy(image if isinstance(image, np.ndarray) else np.array(image))

    bicubic = int(getattr(ip.resample, "value", ip.resample)) == int(Image.Resampling.BICUBIC)
    use = split if pool is not None and grid_of is not None and strips > 1 and bicubic else whole
    try:
        for probe in (probe_image(), probe_image(301, 457), probe_image(530, 700)):
            want = frames(images=[probe], return_tensors="pt")["pixel_values"]
            got = whole(pixels_of(probe))
            if got.dtype != torch.uint8 or not torch.equal(got, want):
                return None
            if use is split and not torch.equal(split(pixels_of(probe)), want):
                use = whole
    except Exception:  # a processor whose resize takes other arguments: its own path it is
        return None
    return FrameResizer(lambda image: use(pixels_of(image)), strips if use is split else 1)


@dataclass(frozen=True)
class FrameResizer:
    """`frame_resizer`'s resize, and the row strips its horizontal pass runs in (1: one call)."""

    resize: Callable[[Image.Image | np.ndarray], Tensor]
    strips: int

    def __call__(self, image: Image.Image | np.ndarray) -> Tensor:
        return self.resize(image)
