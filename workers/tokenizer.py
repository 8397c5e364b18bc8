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

import itertools
import logging
import os
import re
import signal
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import torch

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
from ipc.shm import (
    ShmFullError,
    ShmRef,
    ShmSegment,
    dtype_name,
    link_segment,
    list_segments,
    segment_name,
    shm_prefix,
)
from server.config import ServerConfig
from workers.chat_request import (
    BadRequest,
    ImageRef,
    image_refs,
    parse_request,
    template_messages,
    to_sampling_params,
)
from workers.engine.processor import MMProcessor, ProcessedImage
from workers.media import MediaFetcher, MediaLimits, decode_image

STATS_INTERVAL_S = 0.5
LOCAL_INDEX_SIZE = 4096  # hashes remembered with their newest segment name (a hint; /dev/shm is the truth)
FETCH_THREADS = 8  # downloads are I/O bound; decoding and processing stay on the main thread
_KEY_RE = re.compile(r"^(?P<hash>[0-9a-f]{32})-(?P<t>\d+)x(?P<h>\d+)x(?P<w>\d+)-")
_NO_PIXELS = torch.empty(0)

Grid = tuple[int, int, int]


@dataclass
class _Image:
    """One distinct image of a request while it is being prepared."""

    hash: bytes
    raw: bytes
    param: str
    grid: Grid
    num_tokens: int
    candidates: list[str] = field(default_factory=list)  # live segments to link from (reuse)
    processed: ProcessedImage | None = None  # set when the pixels must be written
    ref: ShmRef | None = None


class TokenizerWorker:
    """The request handling of one tokenizer, independent of sockets."""

    def __init__(self, config: ServerConfig, index: int, log: logging.Logger) -> None:
        self.config = config
        self.index = index
        self.log = log
        self.launch_id = config.launch_id
        if config.max_model_len is None:
            raise ValueError("engine.max_model_len must be resolved by the launcher before children start")
        self.max_model_len = config.max_model_len
        self.processor = MMProcessor(config.engine.model)
        self.dtype = config.engine.torch_dtype()
        ip = self.processor.image_processor
        # Width of one patch row in pixel_values; with the grid it gives a segment's shape from its name.
        self.row = 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2
        self.fetcher = MediaFetcher(MediaLimits.from_config(config))
        self.pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix=f"tok{index}-fetch")
        self.local: OrderedDict[bytes, tuple[str, Grid]] = OrderedDict()
        self.nonce = f"w{index}{os.urandom(3).hex()}-"  # unique names across restarts of this index
        self.counter = 0
        # Back-pressure: the scheduler's last word on shm in flight, plus what we sent since.
        self.shm_bytes = 0
        self.shm_budget = config.shm_budget_bytes
        self.requests = 0
        self.images = 0
        self.images_reused = 0

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
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
            self.log.info("request %s refused: %d %s", req.rid, exc.status, exc.message)
            return exc.to_failed(req.rid)
        except Exception as exc:
            self._release(names)
            self.log.exception("request %s failed", req.rid)
            return RequestFailed(
                req.rid, 500, f"Internal error while preparing the request: {exc}", "server_error"
            )

    def _prepare(self, req: GenerateRequest, names: list[str]) -> tuple[RequestAccepted, TokenizedRequest]:
        chat = parse_request(req.body)
        if chat.model != self.config.served_model_name:
            raise BadRequest(
                f"The model `{chat.model}` does not exist.", status=404, param="model", code="model_not_found"
            )
        refs = image_refs(chat)
        limit = self.config.max_images_per_request
        if len(refs) > limit:
            raise BadRequest(
                f"The request has {len(refs)} images; this server accepts at most {limit} per request.",
                param="messages",
                code="too_many_images",
            )
        if refs and self.shm_bytes >= self.shm_budget:
            raise self._overloaded()  # refuse before spending CPU on a request we could not hand on
        self.images += len(refs)
        order = self._plan_images(refs)
        text = self.processor.render(template_messages(chat))
        prompt = self.processor.build(
            text, [ProcessedImage(im.hash, im.grid, im.num_tokens, _NO_PIXELS) for im in order]
        )
        sampling = to_sampling_params(chat, len(prompt.input_ids), self.max_model_len)
        new_bytes = self._materialize(list({im.hash: im for im in order}.values()), names)
        items = [
            MMItem(span.hash, span.offset, span.length, span.grid, im.ref)
            for span, im in zip(prompt.spans, order, strict=True)
        ]
        self.shm_bytes += new_bytes
        accepted = RequestAccepted(
            req.rid, chat.stream, chat.include_usage, chat.model, len(prompt.input_ids), self.index
        )
        tokenized = TokenizedRequest(
            req.rid, prompt.input_ids, prompt.positions, prompt.mrope_delta, items, sampling, names, new_bytes
        )
        return accepted, tokenized

    def _overloaded(self) -> BadRequest:
        return BadRequest(
            "The server has too many images in flight; retry shortly.",
            status=503,
            type="server_error",
            code="shm_budget_exceeded",
        )

    # ---- images ---------------------------------------------------------------------------------

    def _fetch_all(self, refs: list[ImageRef]) -> list[bytes]:
        """Encoded bytes per image in prompt order; downloads run concurrently, the rest inline."""
        remote = [r.url.lower().startswith(("http://", "https://")) for r in refs]
        if sum(remote) <= 1:
            return [self.fetcher.load(r.url, r.param) for r in refs]
        futures = {
            i: self.pool.submit(self.fetcher.load, r.url, r.param) for i, r in enumerate(refs) if remote[i]
        }
        try:
            return [
                futures[i].result() if i in futures else self.fetcher.load(r.url, r.param)
                for i, r in enumerate(refs)
            ]
        finally:
            for f in futures.values():
                f.cancel()

    def _plan_images(self, refs: list[ImageRef]) -> list[_Image]:
        """Hash every image; find a live segment to reuse or else decode and process it now."""
        by_hash: dict[bytes, _Image] = {}
        order: list[_Image] = []
        listing: dict[str, list[str]] | None = None  # /dev/shm listed at most once per request
        for ref, raw in zip(refs, self._fetch_all(refs), strict=True):
            h = self.processor.media_hash(raw)
            image = by_hash.get(h)
            if image is None:
                candidates: list[str] = []
                grid: Grid | None = None
                hint = self.local.get(h)
                if hint is not None:
                    candidates.append(hint[0])
                    grid = hint[1]
                else:
                    if listing is None:
                        listing = self._list_live()
                    for name in listing.get(h.hex(), []):
                        candidates.append(name)
                        grid = _grid_from_name(name, len(shm_prefix(self.launch_id)))
                if grid is not None:
                    image = _Image(h, raw, ref.param, grid, self._num_tokens(grid), candidates)
                else:
                    image = self._process(h, raw, ref.param)
                by_hash[h] = image
            order.append(image)
        return order

    def _list_live(self) -> dict[str, list[str]]:
        skip = len(shm_prefix(self.launch_id))
        live: dict[str, list[str]] = {}
        for name in list_segments(self.launch_id):
            m = _KEY_RE.match(name, skip)
            if m:
                live.setdefault(m.group("hash"), []).append(name)
        for names in live.values():
            names.reverse()  # a rough "newest first": later names are likelier to outlive the request
        return live

    def _num_tokens(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // (self.processor.merge**2)

    def _process(self, h: bytes, raw: bytes, param: str) -> _Image:
        image = decode_image(raw, self.config.max_image_pixels, param)
        try:
            processed = self.processor.process_image(image, image_hash=h)
        except ValueError as exc:  # e.g. an aspect ratio the processor refuses
            raise BadRequest(
                f"The image cannot be processed: {exc}", param=param, code="invalid_image"
            ) from None
        return _Image(h, raw, param, processed.grid, processed.num_tokens, processed=processed)

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
        fresh = [im for im in images if im.ref is None]
        pixels = [
            im.processed.pixel_values.to(self.dtype).contiguous() for im in fresh if im.processed is not None
        ]
        new_bytes = sum(p.nbytes for p in pixels)
        if new_bytes and self.shm_bytes + new_bytes > self.shm_budget:
            if new_bytes > self.shm_budget:  # could never fit, so retrying would not help
                raise BadRequest(
                    f"The request's images need {new_bytes} bytes of pixels, more than the server's "
                    f"{self.shm_budget}-byte budget.",
                    param="messages",
                    code="images_too_large",
                )
            raise self._overloaded()
        for image, tensor in zip(fresh, pixels, strict=True):
            self._write(image, tensor, names)
        return new_bytes

    def _link(self, image: _Image, names: list[str]) -> bool:
        new = self._new_name(image.hash, image.grid)
        tried = set(image.candidates)
        # The local hint may be stale; then another name of the same image (any tokenizer's) will do.
        fallback = (n for n in self._list_live().get(image.hash.hex(), []) if n not in tried)
        for source in itertools.chain(image.candidates, fallback):
            if link_segment(source, new):
                names.append(new)
                t, h, w = image.grid
                shape = (t * h * w, self.row)
                nbytes = shape[0] * shape[1] * self.dtype.itemsize
                image.ref = ShmRef(new, nbytes, dtype_name(self.dtype), shape)
                self._remember(image.hash, new, image.grid)
                self.images_reused += 1
                return True
        self.local.pop(image.hash, None)
        return False

    def _write(self, image: _Image, pixels: torch.Tensor, names: list[str]) -> None:
        if pixels.shape[1] != self.row:
            raise RuntimeError(f"pixel rows are {pixels.shape[1]} wide, expected {self.row}")
        final = self._new_name(image.hash, image.grid)
        self.counter += 1
        tmp = segment_name(self.launch_id, f"tmp-{self.nonce}{self.counter:x}")
        try:
            seg, ref = ShmSegment.create_from_tensor(tmp, pixels)
        except ShmFullError:
            raise BadRequest(
                "Shared memory is full; retry shortly.", status=503, type="server_error", code="shm_full"
            ) from None
        try:
            seg.close()
            # Publishing under the hash name only now means no other tokenizer links a partial file.
            if not link_segment(tmp, final):
                raise RuntimeError(f"segment {tmp} vanished before it was published")
            names.append(final)
        finally:
            ShmSegment.unlink(tmp)
        image.ref = msgspec.structs.replace(ref, name=final)
        self._remember(image.hash, final, image.grid)

    def _new_name(self, h: bytes, grid: Grid) -> str:
        self.counter += 1
        t, gh, gw = grid
        return segment_name(self.launch_id, f"{h.hex()}-{t}x{gh}x{gw}-{self.nonce}{self.counter:x}")

    def _remember(self, h: bytes, name: str, grid: Grid) -> None:
        self.local[h] = (name, grid)
        self.local.move_to_end(h)
        while len(self.local) > LOCAL_INDEX_SIZE:
            self.local.popitem(last=False)

    def _release(self, names: list[str]) -> None:
        gone = set(names)
        for name in names:
            ShmSegment.unlink(name)
        for h in [h for h, (name, _) in self.local.items() if name in gone]:
            del self.local[h]


def _grid_from_name(name: str, skip: int) -> Grid | None:
    m = _KEY_RE.match(name, skip)
    return (int(m.group("t")), int(m.group("h")), int(m.group("w"))) if m else None


# ---- the process --------------------------------------------------------------------------------


class _RoleFilter(logging.Filter):
    """Stamps the role into every record's logger name, so library lines (transformers, httpx)
    are attributable too when several processes share one stderr."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.tag):
            record.name = f"{self.tag} {record.name}"
        return True


def _setup_logging(level: str, index: int) -> logging.Logger:
    tag = f"glimpse.tokenizer[{index}]"
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_RoleFilter(tag))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per download is noise
    return logging.getLogger(tag)


def run_tokenizer(config: ServerConfig, index: int) -> None:
    """Entry point of tokenizer process `index`; returns (exit 0) on Shutdown or when orphaned."""
    log = _setup_logging(config.log_level, index)
    # Ctrl-C reaches the whole process group; the launcher turns it into a Shutdown message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
