"""The shared-memory segments of a tokenizer's images: their names, the index of live ones, links and writes.

Segments are named ``{hash}-{t}x{h}x{w}-{unique}`` so any tokenizer of the launch can find a live segment of an
image by listing /dev/shm, and knows its grid from the name alone. A resent image is then a hard link to a new
name: no decode, no processing, no write. Pixels (the resized uint8 frame where the processor allows,
pixel_frames.py) are written under a temporary name and published under the hash name only once complete, so a
reader never links a half-written file. ``ImageSegments`` is the bookkeeping side of image_prep.py's
``ImagePrep``, which plans and processes the images these segments hold.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from ipc import shm
from workers.config import ServerConfig
from workers.engine.prompt.media_items import ProcessedImage
from workers.engine.prompt.processor import MMProcessor
from workers.tokenizer.media.image_io import Encoded, write_and_publish

LOCAL_INDEX_SIZE = 4096  # hashes remembered with their newest segment name (a hint; /dev/shm is the truth)
# No "^": match(name, pos) anchors at pos itself, while "^" would only match at index 0.
_KEY_RE = re.compile(r"(?P<hash>[0-9a-f]{32})-(?P<t>\d+)x(?P<h>\d+)x(?P<w>\d+)-")
NO_GRID = (0, 0, 0)  # of an image until it is processed

Grid = tuple[int, int, int]
Listing = dict[str, list[tuple[str, Grid]]]  # live segments of the launch by image hash (hex): (name, grid)


@dataclass
class RequestImage:
    """One distinct image of a request while it is being prepared."""

    hash: bytes
    raw: Encoded
    param: str
    grid: Grid
    candidates: list[str]  # live segments of this image to link from (reuse); empty: process and write
    processed: ProcessedImage | None = None  # the pixels, when they must be written
    ref: shm.ShmRef | None = None  # this request's segment, once linked or written (or named, if deferred)
    deferred: bool = False  # grid from the header: decoded, processed and written after the prompt is sent
    early: Future[ProcessedImage] | None = None  # grid from the header, processing while the prompt is built
    low: bool = False  # detail "low": scaled down before the processor (media.low_detail); its own hash
    budget: int | None = None  # its token budget (families with budgets, MMProcessor.budgets; None: the default)
    size: dict[str, int] | None = None  # the request's pixel range (pixel_range.py; None: the checkpoint's)


@dataclass(frozen=True)
class PendingWrite:
    """A deferred image of a request that was handed on: written under ``tmp``, published as ``final``."""

    image: RequestImage
    tmp: str
    final: str
    # monotonic times of its start on the pool, its pixels processed, its segment published: a step trace reads them
    marks: list[float] = field(default_factory=list)


class ImageSegments:
    """Names, the local index, links and writes of the segments of one tokenizer's images."""

    def __init__(self, config: ServerConfig, index: int, processor: MMProcessor) -> None:
        self.launch_id = config.launch_id
        self.dtype = config.engine.torch_dtype()
        ip = processor.image_processor
        # Width of one patch row in pixel_values; with the grid it gives a segment's shape from its name.
        self.row = 3 * int(getattr(ip, "temporal_patch_size", 1)) * int(ip.patch_size) ** 2  # Gemma 4: no temporal
        self.frame_layout = processor.uint8_frames[0] if processor.uint8_frames is not None else None
        self.local: OrderedDict[bytes, tuple[str, Grid]] = OrderedDict()
        self.nonce = f"w{index}{os.urandom(3).hex()}-"  # unique names across restarts of this index
        self.counter = 0
        self.images_reused = 0

    def live_segments(self, h: bytes, listing: Listing | None) -> tuple[list[tuple[str, Grid]], Listing | None]:
        """Live segments of image ``h`` (name, grid): this process's own, else any tokenizer's from the launch's
        /dev/shm, listed at most once per caller (``listing``: the caller's, None until first needed; returned)."""
        if h in self.local:
            return [self.local[h]], listing
        listing = self._list_live() if listing is None else listing
        return listing.get(h.hex(), []), listing

    def _list_live(self) -> Listing:
        """Live segments of the launch by image hash (hex), with the grid their names carry."""
        skip = len(shm.shm_prefix(self.launch_id))
        live: Listing = {}
        for name in reversed(shm.list_segments(self.launch_id)):
            if m := _KEY_RE.match(name, skip):
                grid = (int(m.group("t")), int(m.group("h")), int(m.group("w")))
                live.setdefault(m.group("hash"), []).append((name, grid))
        return live

    def _ref(self, name: str, grid: Grid) -> shm.ShmRef:
        """The segment of an image of this grid: its uint8 frame where the processor allows (pixel_frames.py), else
        its patch rows in the model's dtype. Every tokenizer of a launch has the same processor, so a name's grid
        tells any of them which."""
        if self.frame_layout is not None:
            shape = self.frame_layout.shape(grid)
            return shm.ShmRef(name, shape[0] * shape[1] * shape[2], "uint8", shape)
        rows = (grid[0] * grid[1] * grid[2], self.row)
        return shm.ShmRef(name, rows[0] * rows[1] * self.dtype.itemsize, shm.dtype_name(self.dtype), rows)

    def _nbytes(self, image: RequestImage) -> int:
        return self._ref("", image.grid).nbytes

    def _new_name(self, image: RequestImage) -> str:
        self.counter += 1
        t, h, w = image.grid
        return shm.segment_name(
            self.launch_id, f"{image.hash.hex()}-{t}x{h}x{w}-{self.nonce}{self.counter:x}"
        )

    def _remember(self, h: bytes, name: str, grid: Grid) -> None:
        self.local[h] = (name, grid)
        self.local.move_to_end(h)
        if len(self.local) > LOCAL_INDEX_SIZE:
            self.local.popitem(last=False)

    def _sources(self, image: RequestImage) -> Iterator[str]:
        yield from image.candidates
        # The local hint may be stale; then another live name of the image (any tokenizer's) will do.
        # Listed only when needed: the common case links the hint and never pays for a listdir.
        yield from (n for n, _ in self._list_live().get(image.hash.hex(), []) if n not in image.candidates)

    def _link(self, image: RequestImage, names: list[str]) -> bool:
        new = self._new_name(image)
        for source in self._sources(image):
            if shm.link_segment(source, new):
                names.append(new)
                image.ref = self._ref(new, image.grid)
                self._remember(image.hash, new, image.grid)
                self.images_reused += 1
                return True
        self.local.pop(image.hash, None)
        return False

    def _write(self, job: tuple[RequestImage, str, str]) -> shm.ShmRef:
        """Write one image's pixels under its temporary name, then publish them under its final one.
        May run on a pool thread: touches only its own two names."""
        image, tmp, final = job
        processed = image.processed
        assert processed is not None
        pixels = processed.pixel_values
        if processed.frame is None and (pixels.dim() != 2 or pixels.shape[1] != self.row):
            raise RuntimeError(f"pixels are {tuple(pixels.shape)}, expected rows {self.row} wide")
        return write_and_publish(self._ref(tmp, image.grid), processed, final)

    def release(self, names: list[str]) -> None:
        """Unlink a failed request's names, and forget them as hints."""
        for name in names:
            shm.ShmSegment.unlink(name)
        gone = set(names)
        for h in [h for h, (name, _) in self.local.items() if name in gone]:
            del self.local[h]
