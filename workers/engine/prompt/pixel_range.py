"""A request's pixel range for its images and video frames (``mm_processor_kwargs``' ``min_pixels`` / ``max_pixels``):
the Qwen processors' ``size={"shortest_edge": min_pixels, "longest_edge": max_pixels}``, and what it does to a
media item's identity.

A range other than the checkpoint's gives other pixels and another grid from the same bytes, so it frames the item's
hash (another segment, embedding and prefix-cache key); the checkpoint's own range, named or not, keeps the plain
hash, so a request that names the default shares the caches of those that leave it out.
"""

from __future__ import annotations

from typing import Any

import blake3

Pixels = tuple[int | None, int | None]  # (min_pixels, max_pixels) as the request gave them; None: the checkpoint's
NO_PIXELS: Pixels = (None, None)


def size_for(processor: Any, pixels: Pixels) -> dict[str, int] | None:
    """transformers' ``size`` for ``processor`` (an image or video processor) under ``pixels``; None where that is the
    processor's own. Raises ValueError where the range is empty once the processor's defaults fill it in."""
    if pixels == NO_PIXELS:
        return None
    size = processor.size
    low = pixels[0] if pixels[0] is not None else int(size.shortest_edge)
    high = pixels[1] if pixels[1] is not None else int(size.longest_edge)
    if low > high:
        which = "min_pixels" if pixels[0] is not None else "max_pixels"
        raise ValueError(f"{which} leaves an empty range (min_pixels {low} > max_pixels {high})")
    if (low, high) == (int(size.shortest_edge), int(size.longest_edge)):
        return None
    return {"shortest_edge": low, "longest_edge": high}


def sized_hash(media_hash: bytes, size: dict[str, int] | None) -> bytes:
    """The identity of a media item resized into ``size`` (`size_for`; None: the checkpoint's range, the plain hash)."""
    if size is None:
        return media_hash
    framing = size["shortest_edge"].to_bytes(8, "little") + size["longest_edge"].to_bytes(8, "little")
    return blake3.blake3(b"glimpse-pixels-v1" + framing + media_hash).digest(16)
