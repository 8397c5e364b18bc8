"""How a uint8 frame in shared memory becomes a ViT's patch rows: ``FrameLayout``, shared by the tokenizers that write
frames (prompt/pixel_frames.py decides where they may; a family with its own image side, Gemma 4, makes its own) and
the model and encoder workers that read them. Here, below both, so that a family's image side can name its layout."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor


def patch_rows_into(frame: Tensor, dst: Tensor, patch: int, merge: int, temporal: int) -> None:
    """Lay a normalised [C, H, W] frame (any strides) out as patch rows in ``dst`` ([t * h * w, C * temporal *
    patch**2], any float dtype): the processor's patchify, its temporal repeat and the cast in one strided copy."""
    c, h, w = frame.shape
    gh, gw = h // patch // merge, w // patch // merge
    # unflatten splits one dimension at a time, a view whatever the strides (a channels-last frame included).
    src = frame.unflatten(2, (gw, merge, patch)).unflatten(1, (gh, merge, patch))  # [c, gh, m, p, gw, m, p]
    src = src.permute(1, 4, 2, 5, 0, 3, 6)  # [gh, gw, m, m, c, p, p]
    dst.view(gh, gw, merge, merge, c, temporal, patch, patch).copy_(
        src.unsqueeze(5).expand(gh, gw, merge, merge, c, temporal, patch, patch)
    )


@dataclass(frozen=True)
class FrameLayout:
    """How a uint8 frame becomes its patch rows: the geometry, and the mean and std fused with the rescale factor
    (float32 values, as the processor computes them).

    ``order`` "windows" is the Qwen-style processors' (each merge window's patches together, channel-major rows,
    normalised); "rows" is Gemma 4's (patches row-major over the grid, each row (y, x, channel), the image only
    rescaled: ``image * scale`` in float32, mean and std unused)."""

    patch: int
    merge: int
    temporal: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    order: str = "windows"
    scale: float = 1.0

    def shape(self, grid: tuple[int, int, int]) -> tuple[int, int, int]:
        """The segment of an image of this (t, h, w) patch grid (t is 1: one image, repeated over the temporal
        patch): its frame [H, W, C], channels-last as decoded and resized, so the tokenizer's write is one memcpy
        (0.2 against 4.2 ms for a 1080p frame laid out [C, H, W] on the way, 2-core box)."""
        if grid[0] != 1:
            raise ValueError(f"a frame holds one image, not a temporal grid of {grid[0]}")
        return grid[1] * self.patch, grid[2] * self.patch, len(self.mean)

    def rows(self, frame: Tensor, dtype: torch.dtype) -> Tensor:
        """A segment's [H, W, C] uint8 frame, on any device -> its [h * w, row] patch rows in ``dtype``, on the same
        device. Per element the same float32 math as the processor's, so the same bits whatever the layout."""
        if self.order == "rows":
            return self._row_major(frame, dtype)
        frame = frame.permute(2, 0, 1)  # [C, H, W], channels-last strides
        mean, std = _constants(self, frame.device)
        normalised = frame.to(torch.float32).sub_(mean).div_(std)  # torchvision's normalize, in its order
        c, h, w = frame.shape
        out = torch.empty(
            (h // self.patch) * (w // self.patch), c * self.temporal * self.patch**2, dtype=dtype, device=frame.device
        )
        patch_rows_into(normalised, out, self.patch, self.merge, self.temporal)
        return out


    def _row_major(self, frame: Tensor, dtype: torch.dtype) -> Tensor:
        """Gemma 4's rows from an [H, W, C] frame (any strides): the processor's ``image * rescale_factor`` in
        float32 (elementwise: the layout changes no bit), then convert_image_to_patches's order, cast in the copy."""
        h, w, c = frame.shape
        p = self.patch
        values = frame.to(torch.float32).mul_(self.scale)
        out = torch.empty(((h // p) * (w // p), p * p * c), dtype=dtype, device=frame.device)
        out.view(h // p, w // p, p, p, c).copy_(values.view(h // p, p, w // p, p, c).permute(0, 2, 1, 3, 4))
        return out


@functools.lru_cache(maxsize=16)
def _constants(layout: FrameLayout, device: torch.device) -> tuple[Tensor, Tensor]:
    return tuple(  # type: ignore[return-value]
        torch.tensor(v, dtype=torch.float32, device=device).view(-1, 1, 1) for v in (layout.mean, layout.std)
    )
