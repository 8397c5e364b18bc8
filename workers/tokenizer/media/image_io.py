"""A tokenizer's image as it arrived (`Encoded`), and the write of pixels into a segment that is published under its
final name only once complete (`write_and_publish`); workers/tokenizer/media/image_prep.py and workers/tokenizer/media/video_prep.py use both."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch

from ipc import shm
from workers.common.errors import BadRequest
from workers.engine.prompt.media_items import ProcessedImage


class Encoded:
    """One image of a request as it arrived: its bytes, or, for a data URL this tokenizer has seen with its image
    still live here, that image's hash and a way to decode the URL if the bytes are needed after all (the segment
    went before it could be linked). A resent image costs a hash of its URL's text, not a base64 decode."""

    __slots__ = ("_data", "_load", "key", "hash")

    def __init__(
        self, data: bytes | None = None, load: Callable[[], bytes] | None = None, key: bytes | None = None,
        hash: bytes | None = None,
    ) -> None:
        self._data, self._load, self.key, self.hash = data, load, key, hash

    def data(self) -> bytes:
        if self._data is None:
            assert self._load is not None, "an Encoded needs its bytes or a way to load them"
            self._data = self._load()
        return self._data


def write_and_publish(ref: shm.ShmRef, pixels: torch.Tensor | ProcessedImage, final: str) -> shm.ShmRef:
    """Write ``pixels`` (or an image's rows) into a new segment under the temporary name ``ref.name``, then
    publish it under ``final``; the temporary name is gone either way. A full /dev/shm is a 503 for the client."""
    try:
        seg = shm.ShmSegment.create(ref.name, ref.nbytes)
    except shm.ShmFullError:
        full = "Shared memory is full; retry shortly."
        raise BadRequest(full, status=503, type="server_error", code="shm_full") from None
    try:
        # float32 -> dtype inside the copy: one pass, and no converted copy of the pixels in between.
        if isinstance(pixels, ProcessedImage):
            pixels.write_rows(seg.tensor(ref))
        else:
            seg.tensor(ref).copy_(pixels)
        seg.close()
        # Publishing under the hash name only now means no other tokenizer links a partial file.
        if not shm.link_segment(ref.name, final):
            raise RuntimeError(f"segment {ref.name} vanished before it was published")
    finally:
        shm.ShmSegment.unlink(ref.name)
    return msgspec.structs.replace(ref, name=final)
