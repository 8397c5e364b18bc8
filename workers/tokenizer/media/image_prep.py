"""A tokenizer's images: a request's encoded images in, one shared-memory name per image out.

Image identity is the hash of the encoded bytes (framed with the processor settings); a resent image is a hard
link to a live segment of it under a new name: no decode, no processing, no write. How segments are named,
found, linked and written is image_segments.py's; this module plans a request's images (reuse or process),
processes the fresh ones and decides when each is written.

The distinct fresh images of one request are decoded, processed and written on a thread pool:
Pillow's decoder, torch's ops and the copy into shm release the GIL, so a request with many new
images does not pay for them one after another inside its time to first token. Everything else
(hashing, reuse, names, the byte budget, the local index) stays on the calling thread, in request
order, so a pool of any size gives the same names, bytes and prompt.

With ``defer`` (overlap of preprocessing and prefill), the fresh images after a request's first one get
their grids from their headers and their names before any pixel is decoded: the prompt goes to the
scheduler once the first is written, and the pool decodes, processes and writes the others while the
first chunks run (`start_writes`). The first is decoded on a thread of its own while the prompt is built.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, ThreadPoolExecutor, wait
from typing import TypeVar

import blake3
import torch
from PIL import Image

from ipc import shm
from workers.common.errors import BadRequest
from workers.config import ServerConfig
from workers.engine.prompt.media_items import ProcessedImage
from workers.engine.prompt.pixel_range import sized_hash
from workers.engine.prompt.processor import MMProcessor
from workers.tokenizer.media.fetch import (
    decode_pixels,
    low_detail,
    low_detail_size,
    probe_decodes,
    probe_image,
)
from workers.tokenizer.media.image_io import Encoded
from workers.tokenizer.media.image_segments import (
    NO_GRID,
    Grid,
    ImageSegments,
    Listing,
    PendingWrite,
    RequestImage,
)
from workers.tokenizer.media.uuids import MediaRecord, UuidRegistry, unknown_uuid

DATA_URL_INDEX_SIZE = 4096  # data URLs remembered by the hash of their text, with their image's hash
_A = TypeVar("_A")
_R = TypeVar("_R")


def core_share(config: ServerConfig) -> int:
    """Cores one tokenizer process may count on: they are shared with the other tokenizers."""
    return max(1, (os.cpu_count() or 1) // max(1, config.tokenizer_workers))


def overloaded() -> BadRequest:
    message = "The server has too many images in flight; retry shortly."
    return BadRequest(message, status=503, type="server_error", code="shm_budget_exceeded")


class ImagePrep(ImageSegments):
    """Reuse, processing and shm segments for the images of one tokenizer's requests."""

    def __init__(self, config: ServerConfig, index: int, processor: MMProcessor) -> None:
        super().__init__(config, index, processor)
        self.config, self.processor = config, processor
        self.data_urls: OrderedDict[bytes, bytes] = OrderedDict()  # see Encoded
        self.max_data_url_chars = 4 * config.max_image_bytes // 3 + 4096  # base64 of the largest image, header
        # When the last request's images were hashed, processed (those not deferred) and written: for the step trace.
        self.marks: dict[str, float] = {}
        # Auto: a thread per core of this process's share, intra-op threads as they are (torch.set_num_threads
        # is process-wide, read once per thread), so k images in flight oversubscribe the share. 8 x 1080p JPEG,
        # 16-core host, 8-core share: serial 492 ms; pool 2/4/8 343/272/274 ms, with 1 intra-op thread each
        # 562/395/251 ms (benchmarks/request_path/tokenizer_bench.py --images-per-request 8 --threads 1,auto).
        self.threads = config.tokenizer_threads or core_share(config)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"tok{index}-image")
        # A request's first fresh image: never queued behind other requests' deferred ones on the pool.
        self.first = ThreadPoolExecutor(1, thread_name_prefix=f"tok{index}-first")
        self.uuids = UuidRegistry(config.launch_id, config.shm_retain_idle_s, self.nonce)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.first.shutdown(wait=True, cancel_futures=True)

    def warm_up(self, prep: Executor) -> None:
        """Pay the image path's one-time costs at start-up, not in the first requests' TTFT: the processor's
        fast-path checks (~15 ms), and on every thread that processes images (``prep``, `first`, each pool thread)
        the first large decode, resize and frame copy, which fault in its malloc arena and start its torch workers
        (a fresh tokenizer's 8 x 1080p request: +25-45 ms to the scheduler, H200 host). Writes nothing to shm."""
        buf = io.BytesIO()
        Image.new("RGB", (1920, 1080), (90, 120, 150)).save(buf, format="JPEG")
        probe = RequestImage(bytes(16), Encoded(buf.getvalue()), "warm-up", NO_GRID, [])
        # All pool tasks wait for each other, so each one runs on a thread of its own (the pool starts a thread
        # per task while none is idle); the timeout only guards against a pool that cannot start them all.
        together = threading.Barrier(self.threads)
        futures = [prep.submit(self._warm, probe, None), self.first.submit(self._warm, probe, None)]
        futures += [self.pool.submit(self._warm, probe, together) for _ in range(self.threads)]
        for future in futures:
            future.result()

    def _warm(self, probe: RequestImage, together: threading.Barrier | None) -> None:
        if together is not None:
            with contextlib.suppress(threading.BrokenBarrierError):
                together.wait(timeout=30)
        processed = self._process(probe)
        ref = self._ref("", processed.grid)
        processed.write_rows(torch.empty(ref.shape, dtype=shm.parse_dtype(ref.dtype)))

    # ---- planning: reuse or process --------------------------------------------------------------

    def encoded(self, url: str, load: Callable[[], bytes]) -> Encoded:
        """A local image of a request (``load`` reads it): a data URL seen with its image live is not decoded, and
        another data URL only once `plan` reaches it, so a request's first fresh image starts decoding before the
        base64 of the others is undone (8 x 1080p: ~0.5 ms each on the 2-core box)."""
        if not url.startswith("data:") or len(url) > self.max_data_url_chars:
            return Encoded(load())  # an oversized one is refused there before anything reads all of it
        key = blake3.blake3(url.encode("utf-8", "surrogatepass")).digest(16)  # any str: the check is the decode's
        if (h := self.data_urls.get(key)) is not None and h in self.local:
            self.data_urls.move_to_end(key)
            return Encoded(load=load, key=key, hash=h)
        return Encoded(load=load, key=key)

    def named(self, uuid: str, param: str) -> Encoded:
        """An image part that names its image by ``uuid`` alone: its hash from the launch's record, and no bytes (a
        400 naming ``param``, the uuid, wherever they would be needed: its segment is gone)."""
        record = self.uuids.get(uuid)
        if record is None or record.kind != "image":
            raise unknown_uuid(uuid, param)

        def gone() -> bytes:
            raise unknown_uuid(uuid, param)

        return Encoded(load=gone, hash=record.digest)

    def plan(
        self, raws: list[Encoded], params: list[str], defer: bool = False, first_too: bool = False,
        low: list[bool] | None = None, budgets: list[int | None] | None = None, size: dict[str, int] | None = None,
        uuids: list[str | None] | None = None,
    ) -> list[RequestImage]:
        """Hash every image; find live segments to reuse, or else decode and process it now (the
        distinct ones that need it all at once), or with ``defer`` only read its grid from the header.
        With ``first_too`` as well, the first fresh image is deferred too (still decoded from the moment it
        is found fresh). ``low``: which images have detail "low"; ``budgets``: each image's token budget (families
        with budgets; None: the default); ``size``: the request's pixel range (pixel_range.py; None: the checkpoint's).
        ``uuids``: the client's ids of the images sent with their bytes, recorded for later requests to name them by.
        One entry per image, repeats sharing theirs."""
        by_hash: dict[bytes, RequestImage] = {}
        order: list[RequestImage] = []
        todo: list[RequestImage] = []
        listing: Listing | None = None  # /dev/shm listed at most once
        self.marks = {}
        nothing: list[None] = [None] * len(raws)
        for raw, param, small, budget, uuid in zip(
            raws, params, low or [False] * len(raws), budgets or nothing, uuids or nothing, strict=True
        ):
            h = self.identify(raw, small, budget, size, uuid)
            if (image := by_hash.get(h)) is not None:
                self.images_reused += 1  # repeated within the request: shares the first one's segment
                order.append(image)
                continue
            live, listing = self.live_segments(h, listing)
            if live:
                image = RequestImage(
                    h, raw, param, live[0][1], [name for name, _ in live], low=small, budget=budget, size=size
                )
            else:
                image = RequestImage(h, raw, param, NO_GRID, [], low=small, budget=budget, size=size)
                todo.append(image)
                if defer and len(todo) == 1:  # decoding from here on, while the rest is hashed and probed
                    self._start_early(image, deferred=first_too)
            by_hash[h] = image
            order.append(image)
        self.marks["hashed"] = time.monotonic()
        # With ``defer`` the first fresh image is still written before the request leaves, unless ``first_too`` (the
        # request has the tokenizer alone, so its text prefills meanwhile; docs/perf-notes.md, session 23): under load
        # a one-image request gains nothing from deferring, and its early arrival cost 6% of throughput (64 concurrent
        # 1080p requests, H100; session 10). It decodes on `first` (not the pool, where other requests' deferred images
        # queue): with ``defer`` from the moment it is found fresh, else where it is the request's only fresh image.
        if not defer and len(todo) == 1:
            self._start_early(todo[0])
        now = [im for im in todo[:1] if im.early is None] + [im for im in todo[1:] if not (defer and self._predict(im))]
        for image, processed in zip(now, self._each(self._process, now), strict=True):
            image.grid, image.processed = processed.grid, processed
        self.marks["processed"] = time.monotonic()
        return order

    def identify(
        self, raw: Encoded, low: bool = False, budget: int | None = None, size: dict[str, int] | None = None,
        uuid: str | None = None,
    ) -> bytes:
        """The image's hash as the caches (and KV events, and renders) know it: its encoded bytes' hash, then its own
        image at detail "low", at another token budget or in another pixel range. ``uuid``: the client's id of these
        bytes, recorded (under the bytes' hash, before this request's settings frame it) for later requests."""
        h = raw.hash if raw.hash is not None else self.processor.media_hash(raw.data())
        if raw.key is not None and raw.hash is None:  # remembered for this URL's next sending
            self.data_urls[raw.key] = h
            if len(self.data_urls) > DATA_URL_INDEX_SIZE:
                self.data_urls.popitem(last=False)
        if uuid is not None:
            self.uuids.put(uuid, MediaRecord("image", h))
        if low:  # other pixels than the same bytes at full detail: another image to the caches
            h = blake3.blake3(b"glimpse-low-detail-v1" + h).digest(16)
        h = self.processor.budgeted(h, budget)  # another budget: other tokens, another image to the caches
        return sized_hash(h, size)  # another pixel range: the same

    def grid_only(self, image: RequestImage) -> Grid:
        """An image's grid with nothing written (a render): from its header, else (a processor that cannot tell a
        grid in advance) from processing its pixels in memory."""
        if self._predict(image):
            return image.grid
        return self._process(image).grid

    def _start_early(self, image: RequestImage, deferred: bool = False) -> bool:
        """Process ``image`` on `first` where its grid comes from its header: materialize waits for it, or with
        ``deferred`` its write does."""
        if probe_decodes(image.raw.data()) or not self._predict(image):
            return False
        image.deferred, image.early = deferred, self.first.submit(self._process, image)
        return True

    def _predict(self, image: RequestImage) -> bool:
        """Read a fresh image's grid from its header (refusing what decoding would refuse for size or format);
        False where the processor cannot tell a grid in advance."""
        width, height = probe_image(image.raw.data(), self.config.max_image_pixels, image.param)
        if image.low:
            width, height = low_detail_size(width, height)
        try:
            grid = self.processor.image_grid(width, height, image.budget, image.size)
        except ValueError as exc:  # e.g. an aspect ratio the processor refuses
            raise BadRequest(
                f"The image cannot be processed: {exc}", param=image.param, code="invalid_image"
            ) from None
        if grid is None:
            return False
        image.grid, image.deferred = grid, True
        return True

    def _each(self, work: Callable[[_A], _R], args: list[_A]) -> list[_R]:
        """`work` over `args`, results in order: on the pool when there are two or more (one runs inline).
        Returns or raises only once no call is running, so nothing writes shm or touches the request's images
        after a failure (calls not started are cancelled); raises the first failure in request order."""
        if len(args) < 2 or self.threads < 2:
            return [work(arg) for arg in args]
        futures = [self.pool.submit(work, arg) for arg in args]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            for future in futures:
                future.cancel()  # a no-op for those running or finished
            wait(futures)
            for future in futures:
                if not future.cancelled() and (exc := future.exception()) is not None:
                    raise exc
        return [f.result() for f in futures]

    def _process(self, image: RequestImage) -> ProcessedImage:
        """Decode and process one image. May run on a pool thread: reads only the image and settings. (An unlucky
        interleaving of decode_pixels's warnings.catch_warnings, not thread-safe before Python 3.14, leaves PIL's
        DecompressionBombWarning ignored for the process: harmless, our own pixel limit being the check.)"""
        decoded = decode_pixels(image.raw.data(), self.config.max_image_pixels, image.param)
        if image.low:
            decoded = low_detail(decoded)
        try:
            return self.processor.process_image(
                decoded, image_hash=image.hash, frame=True, budget=image.budget, size=image.size
            )
        except ValueError as exc:  # e.g. an aspect ratio the processor refuses
            raise BadRequest(
                f"The image cannot be processed: {exc}", param=image.param, code="invalid_image"
            ) from None

    # ---- segments --------------------------------------------------------------------------------

    def materialize(
        self, images: list[RequestImage], names: list[str], shm_bytes: int, budget: int
    ) -> tuple[int, list[PendingWrite]]:
        """Give this request a name for every distinct image: a link to a live segment, else freshly
        written pixels, refused past `budget` bytes in flight (`shm_bytes` now). Every name made is
        appended to `names`, also when this raises. Returns the bytes new to shm, and the deferred
        images: named (``image.ref``), to be written by `start_writes` once the request is handed on."""
        redo = [image for image in images if image.candidates and not self._link(image, names)]  # all copies gone
        for image, processed in zip(redo, self._each(self._process, redo), strict=True):
            if processed.grid != image.grid:
                raise RuntimeError(f"segment name says grid {image.grid}, processing gives {processed.grid}")
            image.processed = processed
        fresh = [
            im for im in images if im.ref is None and (im.processed is not None or im.deferred or im.early is not None)
        ]
        new_bytes = sum(self._nbytes(image) for image in fresh)
        if new_bytes and shm_bytes + new_bytes > budget:
            if new_bytes > budget:  # could never fit, so retrying would not help
                message = f"The images need {new_bytes} bytes of pixels, over the server's {budget}."
                raise BadRequest(message, param="messages", code="images_too_large")
            raise overloaded()
        # Named here and recorded before any segment exists: whichever write fails, release unlinks all the others.
        jobs: list[tuple[RequestImage, str, str]] = []
        for image in fresh:
            final = self._new_name(image)
            self.counter += 1
            jobs.append((image, shm.segment_name(self.launch_id, f"tmp-{self.nonce}{self.counter:x}"), final))
            names.append(final)
        now = [job for job in jobs if not job[0].deferred]
        for image, _, _ in now:
            if image.early is not None:  # decoded beside the prompt: wait for it here
                image.processed = self._as_predicted(image, image.early.result())
        for (image, _, final), ref in zip(now, self._each(self._write, now), strict=True):
            image.ref = ref
            self._remember(image.hash, final, image.grid)
        self.marks["written"] = time.monotonic()
        later = [PendingWrite(image, tmp, final) for image, tmp, final in jobs if image.deferred]
        for job in later:
            job.image.ref = self._ref(job.final, job.image.grid)
        return new_bytes, later

    def start_writes(self, writes: list[PendingWrite]) -> list[Future[shm.ShmRef]]:
        """Decode, process and write the deferred images on the pool, one future each (in `writes` order).
        `abandon` stops them; `remember` records the finished ones as reuse hints (on the calling thread)."""
        return [self.pool.submit(self._process_and_write, job) for job in writes]

    def _process_and_write(self, job: PendingWrite) -> shm.ShmRef:
        image = job.image
        job.marks.append(time.monotonic())
        image.processed = self._as_predicted(image, image.early.result() if image.early is not None else self._process(image))
        job.marks.append(time.monotonic())
        try:
            return self._write((image, job.tmp, job.final))
        finally:
            image.processed = None  # the pixels are in shm now; the request must not keep a second copy
            job.marks.append(time.monotonic())

    def _as_predicted(self, image: RequestImage, processed: ProcessedImage) -> ProcessedImage:
        if processed.grid != image.grid:
            # The header promised another size than the data holds (e.g. an orientation stored after the pixels).
            raise BadRequest(
                f"The image data does not match its header (grid {processed.grid}, header {image.grid}).",
                param=image.param,
                code="invalid_image",
            )
        return processed

    def abandon(self, futures: list[Future[shm.ShmRef]], names: Iterable[str]) -> None:
        """Stop deferred writes (cancel those not started, wait for the running ones), then unlink ``names``."""
        for future in futures:
            future.cancel()
        wait(futures)
        self.release(list(names))

    def remember(self, writes: list[PendingWrite]) -> None:
        for job in writes:
            self._remember(job.image.hash, job.final, job.image.grid)

