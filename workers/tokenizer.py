"""Tokenizer worker process: HTTP body in, ready prompt with pixels in shared memory out.

All CPU work of a request happens here, never on the frontend's event loop: JSON parsing and
validation, base64, downloads, decoding, hashing, image processing, the chat template and
tokenization. Per request the worker answers the frontend with `RequestAccepted` and hands the
scheduler a `TokenizedRequest`, or answers `RequestFailed` and sends the scheduler nothing.

Image identity is the hash of the encoded bytes (framed with the processor settings). Segments are
named ``{hash}-{t}x{h}x{w}-{unique}`` so any tokenizer of the launch can find a live segment of an
image by listing /dev/shm, and knows its grid from the name alone. A resent image is then a hard
link to a new name: no decode, no processing, no write. Pixels are written under a temporary name
and published under the hash name only once complete, so a reader never links a half-written file.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

import jinja2
import msgspec
import torch

from ipc import shm
from ipc.channels import PullSocket, PushSocket, new_context
from ipc.launch import ipc_address
from ipc.messages import (
    FrontendInbound,
    GenerateRequest,
    MMItem,
    ProcessReady,
    RequestAccepted,
    RequestFailed,
    SchedulerInbound,
    SchedulerStats,
    Shutdown,
    TokenizedRequest,
    TokenizerInbound,
    TokenizerStats,
)
from server.config import ServerConfig
from workers.chat_request import BadRequest, image_refs, parse_request, template_messages, to_sampling_params
from workers.engine.processor import MMProcessor, ProcessedImage
from workers.media import MediaFetcher, MediaLimits, decode_image
from workers.proc import setup_child

STATS_INTERVAL_S = 0.5
LOCAL_INDEX_SIZE = 4096  # hashes remembered with their newest segment name (a hint; /dev/shm is the truth)
# No "^": match(name, pos) anchors at pos itself, while "^" would only match at index 0.
_KEY_RE = re.compile(r"(?P<hash>[0-9a-f]{32})-(?P<t>\d+)x(?P<h>\d+)x(?P<w>\d+)-")
_NO_PIXELS = torch.empty(0)

Grid = tuple[int, int, int]


@dataclass
class _Image:
    """One distinct image of a request while it is being prepared."""

    hash: bytes
    raw: bytes
    param: str
    grid: Grid
    candidates: list[str]  # live segments of this image to link from (reuse); empty: write
    processed: ProcessedImage | None = None  # the pixels, when they must be written
    ref: shm.ShmRef | None = None  # this request's segment, once linked or written


def _overloaded() -> BadRequest:
    message = "The server has too many images in flight; retry shortly."
    return BadRequest(message, status=503, type="server_error", code="shm_budget_exceeded")


class TokenizerWorker:
    """The request handling of one tokenizer, independent of sockets."""

    def __init__(self, config: ServerConfig, index: int, log: logging.Logger) -> None:
        if config.max_model_len is None:
            raise ValueError("engine.max_model_len must be resolved by the launcher before children start")
        self.config, self.index, self.log = config, index, log
        self.launch_id = config.launch_id
        self.max_model_len = config.max_model_len
        self.processor = MMProcessor(config.engine.model)
        self.dtype = config.engine.torch_dtype()
        ip = self.processor.image_processor
        # Width of one patch row in pixel_values; with the grid it gives a segment's shape from its name.
        self.row = 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2
        self.fetcher = MediaFetcher(MediaLimits.from_config(config))
        self.local: OrderedDict[bytes, tuple[str, Grid]] = OrderedDict()
        self.nonce = f"w{index}{os.urandom(3).hex()}-"  # unique names across restarts of this index
        self.counter = 0
        # Back-pressure: the scheduler's last word on shm in flight, plus what we sent since.
        self.shm_bytes = 0
        self.shm_budget = config.shm_budget_bytes
        self.requests = self.images = self.images_reused = 0

    def close(self) -> None:
        self.fetcher.close()

    def on_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.shm_bytes = stats.shm_bytes
        self.shm_budget = stats.shm_budget_bytes

    def stats(self, queue_depth: int) -> TokenizerStats:
        return TokenizerStats(self.index, queue_depth, self.requests, self.images, self.images_reused)

    # ---- one request ----------------------------------------------------------------------------

    def handle(self, req: GenerateRequest) -> tuple[RequestAccepted, TokenizedRequest] | RequestFailed:
        """Prepare one request. Names created here are unlinked again on any failure, since the
        scheduler (the owner of unlinking) only learns of them through the TokenizedRequest."""
        self.requests += 1
        names: list[str] = []
        try:
            return self._prepare(req, names)
        except BadRequest as exc:
            self._release(names)
            # Client mistakes are the frontend's access log's business; overload is the operator's.
            level = logging.WARNING if exc.status >= 500 else logging.DEBUG
            self.log.log(level, "request %s refused: %d %s", req.rid, exc.status, exc.message)
            return exc.to_failed(req.rid)
        except Exception as exc:
            self._release(names)
            self.log.exception("request %s failed", req.rid)
            return RequestFailed(req.rid, 500, f"Internal error preparing the request: {exc}", "server_error")

    def _prepare(self, req: GenerateRequest, names: list[str]) -> tuple[RequestAccepted, TokenizedRequest]:
        chat = parse_request(req.body)
        if chat.model != self.config.served_model_name:
            message = f"The model `{chat.model}` does not exist."
            raise BadRequest(message, status=404, param="model", code="model_not_found")
        refs = image_refs(chat)
        if len(refs) > (limit := self.config.max_images_per_request):
            message = f"The request has {len(refs)} images; this server accepts at most {limit}."
            raise BadRequest(message, param="messages", code="too_many_images")
        if refs and self.shm_bytes >= self.shm_budget:
            raise _overloaded()  # refuse before spending CPU on a request we could not hand on
        self.images += len(refs)
        raws = self.fetcher.load_many([(r.url, r.param) for r in refs])
        order = self._plan_images(raws, [r.param for r in refs])
        merge2 = self.processor.merge**2
        placeholders = [
            ProcessedImage(im.hash, im.grid, _prod(im.grid) // merge2, _NO_PIXELS) for im in order
        ]
        try:
            prompt = self.processor.build(self.processor.render(template_messages(chat)), placeholders)
        except (ValueError, jinja2.TemplateError) as exc:  # e.g. image-pad tokens typed into the text
            raise BadRequest(f"The messages cannot be made into a prompt: {exc}", param="messages") from None
        sampling = to_sampling_params(chat, len(prompt.input_ids), self.max_model_len)
        # Segments only now, after every check that could refuse the request.
        new_bytes = self._materialize(list({im.hash: im for im in order}.values()), names)
        self.shm_bytes += new_bytes
        items = [
            MMItem(s.hash, s.offset, s.length, s.grid, im.ref)
            for s, im in zip(prompt.spans, order, strict=True)
        ]
        n = len(prompt.input_ids)
        accepted = RequestAccepted(req.rid, chat.stream, chat.include_usage, chat.model, n, self.index)
        tokenized = TokenizedRequest(
            req.rid, prompt.input_ids, prompt.positions, prompt.mrope_delta, items, sampling, names, new_bytes
        )
        return accepted, tokenized

    # ---- images ---------------------------------------------------------------------------------

    def _plan_images(self, raws: list[bytes], params: list[str]) -> list[_Image]:
        """Hash every image; find live segments to reuse, or else decode and process it now."""
        by_hash: dict[bytes, _Image] = {}
        order: list[_Image] = []
        listing: dict[str, list[tuple[str, Grid]]] | None = None  # /dev/shm listed at most once
        for raw, param in zip(raws, params, strict=True):
            h = self.processor.media_hash(raw)
            if (image := by_hash.get(h)) is not None:
                self.images_reused += 1  # repeated within the request: shares the first one's segment
                order.append(image)
                continue
            live = [self.local[h]] if h in self.local else None
            if live is None:
                listing = self._list_live() if listing is None else listing
                live = listing.get(h.hex(), [])
            if live:
                image = _Image(h, raw, param, live[0][1], [name for name, _ in live])
            else:
                image = self._process(h, raw, param)
            by_hash[h] = image
            order.append(image)
        return order

    def _list_live(self) -> dict[str, list[tuple[str, Grid]]]:
        """Live segments of the launch by image hash (hex), with the grid their names carry."""
        skip = len(shm.shm_prefix(self.launch_id))
        live: dict[str, list[tuple[str, Grid]]] = {}
        for name in reversed(shm.list_segments(self.launch_id)):
            if m := _KEY_RE.match(name, skip):
                grid = (int(m.group("t")), int(m.group("h")), int(m.group("w")))
                live.setdefault(m.group("hash"), []).append((name, grid))
        return live

    def _process(self, h: bytes, raw: bytes, param: str) -> _Image:
        image = decode_image(raw, self.config.max_image_pixels, param)
        try:
            processed = self.processor.process_image(image, image_hash=h)
        except ValueError as exc:  # e.g. an aspect ratio the processor refuses
            raise BadRequest(
                f"The image cannot be processed: {exc}", param=param, code="invalid_image"
            ) from None
        return _Image(h, raw, param, processed.grid, [], processed)

    def _materialize(self, images: list[_Image], names: list[str]) -> int:
        """Give this request a name for every image: a link to a live segment, else freshly written
        pixels. Returns the bytes newly written to shm."""
        for image in images:
            if image.candidates and not self._link(image, names):
                # Every live copy was unlinked since we looked: fall back to doing the work.
                redo = self._process(image.hash, image.raw, image.param)
                if redo.grid != image.grid:
                    raise RuntimeError(f"segment name says grid {image.grid}, processing gives {redo.grid}")
                image.processed = redo.processed
        fresh = [
            (im, im.processed.pixel_values.to(self.dtype)) for im in images if im.processed and not im.ref
        ]
        new_bytes = sum(pixels.nbytes for _, pixels in fresh)
        if new_bytes and self.shm_bytes + new_bytes > self.shm_budget:
            if new_bytes > self.shm_budget:  # could never fit, so retrying would not help
                message = f"The images need {new_bytes} bytes of pixels, over the server's {self.shm_budget}."
                raise BadRequest(message, param="messages", code="images_too_large")
            raise _overloaded()
        for image, pixels in fresh:
            self._write(image, pixels.contiguous(), names)
        return new_bytes

    def _sources(self, image: _Image) -> Iterator[str]:
        yield from image.candidates
        # The local hint may be stale; then another live name of the image (any tokenizer's) will do.
        # Listed only when needed: the common case links the hint and never pays for a listdir.
        yield from (n for n, _ in self._list_live().get(image.hash.hex(), []) if n not in image.candidates)

    def _link(self, image: _Image, names: list[str]) -> bool:
        new = self._new_name(image)
        for source in self._sources(image):
            if shm.link_segment(source, new):
                names.append(new)
                shape = (_prod(image.grid), self.row)
                nbytes = shape[0] * shape[1] * self.dtype.itemsize
                image.ref = shm.ShmRef(new, nbytes, shm.dtype_name(self.dtype), shape)
                self._remember(image.hash, new, image.grid)
                self.images_reused += 1
                return True
        self.local.pop(image.hash, None)
        return False

    def _write(self, image: _Image, pixels: torch.Tensor, names: list[str]) -> None:
        if pixels.shape[1] != self.row:
            raise RuntimeError(f"pixel rows are {pixels.shape[1]} wide, expected {self.row}")
        final = self._new_name(image)
        self.counter += 1
        tmp = shm.segment_name(self.launch_id, f"tmp-{self.nonce}{self.counter:x}")
        try:
            seg, ref = shm.ShmSegment.create_from_tensor(tmp, pixels)
        except shm.ShmFullError:
            full = "Shared memory is full; retry shortly."
            raise BadRequest(full, status=503, type="server_error", code="shm_full") from None
        try:
            seg.close()
            # Publishing under the hash name only now means no other tokenizer links a partial file.
            if not shm.link_segment(tmp, final):
                raise RuntimeError(f"segment {tmp} vanished before it was published")
            names.append(final)
        finally:
            shm.ShmSegment.unlink(tmp)
        image.ref = msgspec.structs.replace(ref, name=final)
        self._remember(image.hash, final, image.grid)

    def _new_name(self, image: _Image) -> str:
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

    def _release(self, names: list[str]) -> None:
        for name in names:
            shm.ShmSegment.unlink(name)
        gone = set(names)
        for h in [h for h, (name, _) in self.local.items() if name in gone]:
            del self.local[h]


def _prod(grid: Grid) -> int:
    return grid[0] * grid[1] * grid[2]


# ---- the process --------------------------------------------------------------------------------


def run_tokenizer(config: ServerConfig, index: int) -> None:
    """Entry point of tokenizer process `index`; returns (exit 0) on Shutdown or when orphaned."""
    log = setup_child(f"glimpse.tokenizer[{index}]", config.log_level)
    parent = os.getppid()
    # Several tokenizers share the cores with the scheduler; one torch pool per core each would oversubscribe.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, config.tokenizer_workers)))
    worker = TokenizerWorker(config, index, log)
    ctx = new_context()
    lid = config.launch_id
    inbound = PullSocket[TokenizerInbound](ctx, ipc_address(lid, f"tok{index}"), TokenizerInbound, bind=True)
    frontend = PushSocket[FrontendInbound](ctx, ipc_address(lid, "frontend"), FrontendInbound, bind=False)
    sched = PushSocket[SchedulerInbound](ctx, ipc_address(lid, "sched"), SchedulerInbound, bind=False)
    try:
        frontend.send(ProcessReady("tokenizer", index, os.getpid()))
        log.info("ready (pid %d, model %s)", os.getpid(), config.served_model_name)
        _serve(worker, inbound, frontend, sched, parent)
    finally:
        worker.close()
        inbound.close()
        # A short linger lets the last replies out without hanging on a frontend that is gone.
        frontend.close(linger_ms=500)
        sched.close(linger_ms=500)
        ctx.term()
    log.info("stopped")


def _serve(
    worker: TokenizerWorker,
    inbound: PullSocket[TokenizerInbound],
    frontend: PushSocket[FrontendInbound],
    sched: PushSocket[SchedulerInbound],
    parent: int,
) -> None:
    """Drain everything waiting into a local queue (so queue depth is known and scheduler stats and
    Shutdown are seen at once), then handle one request; repeat."""
    pending: deque[GenerateRequest] = deque()
    last_stats = 0.0
    while True:
        msg = inbound.recv(0 if pending else int(STATS_INTERVAL_S * 1000))
        while msg is not None:
            if isinstance(msg, GenerateRequest):
                pending.append(msg)
            elif isinstance(msg, SchedulerStats):
                worker.on_scheduler_stats(msg)
            elif isinstance(msg, Shutdown):
                worker.log.info(
                    "shutdown (%s); failing %d queued requests", msg.reason or "no reason", len(pending)
                )
                for req in pending:
                    frontend.send(RequestFailed(req.rid, 503, "The server is shutting down.", "server_error"))
                return
            msg = inbound.recv(0)
        if pending:
            req = pending.popleft()
            result = worker.handle(req)
            if isinstance(result, RequestFailed):
                frontend.send(result)
            else:
                # Accepted first: the frontend must know how to answer before outputs can arrive.
                frontend.send(result[0])
                sched.send(result[1])
        now = time.monotonic()
        if now - last_stats >= STATS_INTERVAL_S or not pending:
            frontend.send(worker.stats(len(pending)))
            last_stats = now
        if os.getppid() != parent:
            worker.log.warning("launcher is gone; exiting")
            return
