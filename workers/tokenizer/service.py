"""The requests in flight in one tokenizer process (workers/tokenizer/process.py is the process's entry).

The process runs an asyncio loop that owns the sockets and the downloads (coroutines: a slow URL
occupies no thread and delays only its own request); the CPU steps of a request (parse, tokenize,
images, shm) run on one "prep" thread, one request after another, and fan a request's fresh images
out to the image pool. A request whose client went away (AbortRequest) or that Shutdown finds
unfinished is cancelled wherever it is: its download stops at once, a CPU step already running
finishes and is thrown away, and the shm names it made are unlinked on the prep thread after it.
Every GenerateRequest gets exactly one answer (RequestAccepted, RequestRendered or RequestFailed), which is what
frees its slot in the frontend's routing.

A request with deferred images (overlap of preprocessing and prefill) goes to the scheduler once its first
new image is written, before the later ones are; each image is reported (MediaReady) as it lands, and the frontend's
RequestAccepted goes out just before the last report, so no output can precede it. If an image then
fails, or the client leaves, the writes stop, the names never reported are unlinked here (the scheduler
owns the rest) and the scheduler is told to drop the request (MediaFailed): the client gets a clean 4xx.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from ipc import endpoints
from ipc.channels import AsyncPushSocket, new_async_context
from ipc.control import AbortRequest, ProcessReady, RequestFailed, Shutdown
from ipc.inbound import FrontendInbound, SchedulerInbound
from ipc.prompts import MediaFailed, MediaReady, TokenizedRequest
from ipc.requests import RENDER_ENDPOINTS, GenerateRequest, RequestAccepted, RequestRendered, RouteRequest
from ipc.shm import ShmRef
from ipc.stats import SchedulerStats
from workers.common import memory
from workers.common.errors import BadRequest
from workers.common.full_collections import FullCollections
from workers.common.memory import trim_memory
from workers.common.proc import freeze_heap
from workers.common.step_trace import StepTrace
from workers.engine.core.kv_cache import block_hashes
from workers.tokenizer.media.image_prep import PendingWrite
from workers.tokenizer.render import render
from workers.tokenizer.worker import Admitted, TokenizerWorker

STATS_INTERVAL_S = 0.5
# After a body this large the allocator is asked to give its memory back (see IdleTrim): at once past _HUGE_BODY,
# else once the process has been idle TRIM_IDLE_S.
_BIG_BODY, _HUGE_BODY = 4 << 20, 16 << 20
TRIM_IDLE_S = 10.0
# Prefix keys a routed request carries (16K tokens at block size 16): the first blocks already tell one
# conversation from another, and deeper keys would only cost bytes and router memory.
ROUTE_MAX_BLOCKS = 1024
_T = TypeVar("_T")
# A prepared request: the frontend's answer, the scheduler's bytes, the images to write after sending them.
_Ready = tuple[RequestAccepted, bytes, list[PendingWrite]]


@dataclass
class _Writes:
    """The deferred images of a request being written: which ones the scheduler has been told of."""

    writes: list[PendingWrite]
    futures: list[Future[ShmRef]]
    sent: bool = False  # the TokenizedRequest went out: the scheduler owns every name but the unreported ones
    reported: set[bytes] = field(default_factory=set)

    def ours(self, names: list[str]) -> list[str]:
        """Names this tokenizer must unlink if the request fails now."""
        return names if not self.sent else [w.final for w in self.writes if w.image.hash not in self.reported]


def route_request(tokenized: TokenizedRequest, encoded: bytes, block_size: int) -> RouteRequest:
    """The router's view of a prepared request: the keys its replica's prefix cache and embedding cache
    will hold (the same content hashes the scheduler computes), and the request itself, already encoded."""
    blocks = block_hashes(tokenized.input_ids, block_size, ROUTE_MAX_BLOCKS, items=tokenized.items)
    images = list({it.hash: (it.hash, it.offset, it.length) for it in tokenized.items}.values())
    return RouteRequest(tokenized.rid, len(tokenized.input_ids), blocks, images, msgspec.Raw(encoded))


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a finished future's exception as seen (asyncio logs those nobody asked for)."""
    if not future.cancelled():
        future.exception()


class IdleTrim(memory.IdleTrim):
    """The shared idle-trim policy (workers/common/memory.py) with a tokenizer's thresholds: request bodies past
    4 MB are trimmed after once idle, past 16 MB at once."""

    def __init__(self, idle_s: float = TRIM_IDLE_S) -> None:
        super().__init__(idle_s, _BIG_BODY, _HUGE_BODY)


class TokenizerService:
    """The requests in flight in one tokenizer process: one asyncio task each, CPU steps on the
    prep thread, downloads on the loop. Owns the sending sockets (only the loop thread sends)."""

    def __init__(
        self,
        worker: TokenizerWorker,
        frontend: AsyncPushSocket[FrontendInbound],
        sched: AsyncPushSocket[SchedulerInbound],
    ) -> None:
        self.worker, self.frontend, self.sched = worker, frontend, sched
        # --dp > 1: prepared requests go to the frontend's router (on the frontend socket, after their
        # RequestAccepted, so the two stay in order), which forwards them to a replica's scheduler.
        self.routed = worker.config.dp_size > 1
        # One thread: the CPU steps of requests run one after another, as they always did, so
        # ImagePrep's bookkeeping needs no lock; its image pool still spreads one request's images.
        self.prep = ThreadPoolExecutor(1, thread_name_prefix=f"tok{worker.index}-prep")
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.cancelled: dict[str, tuple[int, str]] = {}  # rid -> the answer its cancellation gets
        self._encoder = msgspec.msgpack.Encoder()  # the prep thread's own: sockets' encoders stay on the loop
        self.trace = StepTrace(f"tokenizer{worker.index}")  # GLIMPSE_STEP_TRACE: where a request's time goes here
        self.trim = IdleTrim()
        # The oldest generation collected when idle (full_collections.py): a pause here is a request's first token
        # later. Off until serve_tokenizer turns it on once ready (tests drive services in-process).
        self.full = FullCollections(enabled=False)

    async def on_prep(self, fn: Callable[..., _T], *args: Any) -> _T:
        # Cancelling the await drops a step that has not started; one already running finishes.
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    def start(self, req: GenerateRequest) -> None:
        if req.rid in self.tasks:
            self.worker.log.error("request %s arrived twice; ignoring the second", req.rid)
            return
        run = self._render(req) if req.endpoint in RENDER_ENDPOINTS else self._run(req)
        task = asyncio.get_running_loop().create_task(run, name=f"request-{req.rid}")
        self.tasks[req.rid] = task
        task.add_done_callback(lambda _: self.tasks.pop(req.rid, None))

    def cancel(self, rid: str, status: int, message: str) -> bool:
        task = self.tasks.get(rid)
        if task is None or task.done():
            return False  # answered already (or never seen): the scheduler handles the abort
        self.cancelled[rid] = (status, message)
        task.cancel()
        return True

    # ---- on the prep thread ----

    def _admit_and_prepare(self, req: GenerateRequest, names: list[str], alone: bool) -> tuple[Admitted, _Ready | None]:
        """Admit; without downloads to wait for, prepare at once too (one thread hop, not two)."""
        admitted = self.worker.admit(req)
        self.trace.event("admitted", rid=req.rid)
        return admitted, None if admitted.remote else self._prepare(req, admitted, names, alone)

    def _prepare(self, req: GenerateRequest, admitted: Admitted, names: list[str], alone: bool) -> _Ready:
        accepted, tokenized, writes = self.worker._prepare(req, admitted, names, defer=True, alone=alone)
        self.trace.event("prepared", rid=req.rid, deferred=len(writes), **self.worker.prep.marks)
        try:
            # Encoded before anything is sent: a value msgpack cannot carry (an integer past 64 bits)
            # is the client's mistake, and must not strand an accepted request.
            encoded = self._encoder.encode(tokenized)
            if self.routed:
                encoded = self._encoder.encode(route_request(tokenized, encoded, self.worker.config.engine.block_size))
            return accepted, encoded, writes
        except (OverflowError, TypeError, ValueError) as exc:
            raise BadRequest(f"A value in the request is out of range: {exc}.", code="invalid_value") from None

    # ---- on the loop ----

    async def _run(self, req: GenerateRequest) -> None:
        names: list[str] = []
        worker = self.worker
        writing: _Writes | None = None
        self.trace.event("recv", rid=req.rid, bytes=len(req.body))
        try:
            # Alone here, even its first fresh image is written after the request is sent: the scheduler starts on
            # the text before it meanwhile. Not under load, where that fragmented the first steps (ImagePrep.plan).
            alone = len(self.tasks) == 1
            admitted, ready = await self.on_prep(self._admit_and_prepare, req, names, alone)
            if ready is None:
                await worker.fetch(admitted)
                ready = await self.on_prep(self._prepare, req, admitted, names, alone)
            accepted, encoded, writes = ready
            if writes:
                # Sent before the deferred images start: their decoding on the pool holds the GIL for stretches,
                # which kept this send back by ~9 ms (8 x 1080p, H200 host).
                writing = _Writes(writes, [])
                await self.sched.send_bytes(encoded)
                writing.sent = True
                writing.futures = worker.prep.start_writes(writes)
                last = await self._follow(req.rid, writing)
                if self.trace.enabled:
                    self.trace.event("landed", rid=req.rid, marks=[job.marks for job in writes])
        except asyncio.CancelledError:
            # Queued behind any step of this request still running on the prep thread, so the
            # names list is complete when the release reads it.
            await self._give_up(req.rid, names, writing)
            status, message = self.cancelled.pop(req.rid, (503, "The request was cancelled."))
            await self.frontend.send(RequestFailed(req.rid, status, message, "server_error"))
        except Exception as exc:
            await self._give_up(req.rid, names, writing)
            await self.frontend.send(worker.failure(req, exc))
        else:
            # Shielded: once the request is accepted, the scheduler must get it (and its shm names) or its last
            # images, even if an abort lands in between; the abort then reaches the scheduler too. The last
            # images go out behind the answer: outputs cannot come before the prefill that needs them.
            await asyncio.shield(self._hand_on(accepted, encoded if writing is None else MediaReady(req.rid, last)))
            if writing is not None:
                self.prep.submit(worker.prep.remember, writing.writes)
        finally:
            alone, now = len(self.tasks) == 1, time.monotonic()
            if self.trim.finished(len(req.body), now, alone):
                self.prep.submit(trim_memory)
            self.full.worked(now, alone)
            if alone:  # the last one in flight: report the idle state now, not at the tick
                await self.frontend.send(worker.stats(0))

    async def _render(self, req: GenerateRequest) -> None:
        """A render (workers/tokenizer/render.py): answered to the frontend alone; it made no shm name to release."""
        try:
            answer: RequestRendered | RequestFailed = RequestRendered(req.rid, await render(self.worker, self.on_prep, req))
        except asyncio.CancelledError:
            status, message = self.cancelled.pop(req.rid, (503, "The request was cancelled."))
            answer = RequestFailed(req.rid, status, message, "server_error")
        except Exception as exc:
            answer = self.worker.failure(req, exc)
        await self.frontend.send(answer)

    async def _follow(self, rid: str, writing: _Writes) -> list[bytes]:
        """Report the deferred images to the scheduler as they land, all but the last batch, which is returned
        (it goes out behind the frontend's answer); raises the first failure."""
        waiting: dict[asyncio.Future[ShmRef], bytes] = {}
        for future, write in zip(writing.futures, writing.writes, strict=True):
            wrapped = asyncio.wrap_future(future)
            wrapped.add_done_callback(_retrieved)  # images failing after the first failure are not errors to log
            waiting[wrapped] = write.image.hash
        while True:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            errors = [exc for future in done if (exc := future.exception()) is not None]
            if errors:
                raise errors[0]
            hashes = [waiting.pop(future) for future in done]
            if not waiting:
                return hashes
            # Counted as reported before the send: if a cancellation stops the send, the names stay with the
            # scheduler's pending record, which MediaFailed unlinks (the images are written by now).
            writing.reported.update(hashes)
            await self.sched.send(MediaReady(rid, hashes))

    async def _give_up(self, rid: str, names: list[str], writing: _Writes | None) -> None:
        """A failed or cancelled request: unlink the names that are ours (after stopping any deferred writes,
        on the prep thread behind the request's own steps), and tell the scheduler if it has the request."""
        if writing is None:
            self.prep.submit(self.worker.prep.release, names)
            return
        self.prep.submit(self.worker.prep.abandon, writing.futures, writing.ours(names))
        if writing.sent:
            await self.sched.send(MediaFailed(rid))

    async def _hand_on(self, accepted: RequestAccepted, then: bytes | MediaReady) -> None:
        # Accepted first: the frontend must know how to answer before outputs can arrive.
        await self.frontend.send(accepted)
        if isinstance(then, MediaReady):
            await self.sched.send(then)
        else:
            await (self.frontend if self.routed else self.sched).send_bytes(then)

    async def stop(self, reason: str) -> None:
        """Fail every request in flight with 503 and wait for them (a running CPU step finishes)."""
        tasks = list(self.tasks.values())
        self.worker.log.info("shutdown (%s); failing %d requests in flight", reason, len(tasks))
        for rid in list(self.tasks):
            self.cancel(rid, 503, "The server is shutting down.")
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        await asyncio.get_running_loop().run_in_executor(None, self.prep.shutdown)
        await self.worker.fetcher.aclose()


async def serve_tokenizer(worker: TokenizerWorker, parent: int) -> None:
    """Route inbound messages until Shutdown or the launcher's death; stats every interval."""
    log, index, lid = worker.log, worker.index, worker.config.launch_id
    ctx = new_async_context()
    inbound = endpoints.apull(ctx, lid, endpoints.TOKENIZER, index)
    frontend = endpoints.apush(ctx, lid, endpoints.FRONTEND)
    sched = endpoints.apush(ctx, lid, endpoints.SCHEDULER)
    service = TokenizerService(worker, frontend, sched)
    reason = "the launcher is gone"
    loop = asyncio.get_running_loop()
    try:
        try:  # on the threads that will process images, before "ready"
            worker.warm_up(service.prep)
        except Exception:  # e.g. a processor that refuses the probe's size: its first request pays, and answers for it
            log.warning("the image path's warm-up failed; the first images pay its one-time costs", exc_info=True)
        freeze_heap(log)
        service.full = FullCollections()
        await frontend.send(ProcessReady("tokenizer", index, os.getpid()))
        log.info("ready (pid %d, model %s)", os.getpid(), worker.config.served_model_name)
        next_stats = loop.time()
        while os.getppid() == parent:
            if loop.time() >= next_stats:  # by the clock: scheduler stats arrive more often than this
                await frontend.send(worker.stats(len(service.tasks)))
                next_stats = loop.time() + STATS_INTERVAL_S
            msg = await inbound.recv(int(STATS_INTERVAL_S * 1000))
            now, idle = time.monotonic(), not service.tasks
            if service.trim.due(now, idle):
                service.prep.submit(trim_memory)
            service.full.poll(now, idle)
            if isinstance(msg, GenerateRequest):
                service.start(msg)
            elif isinstance(msg, AbortRequest):
                service.cancel(msg.rid, 499, "The client closed the request.")
            elif isinstance(msg, SchedulerStats):
                worker.on_scheduler_stats(msg)
            elif isinstance(msg, Shutdown):
                reason = msg.reason or "no reason given"
                break
        else:
            log.warning("launcher is gone; exiting")
        await service.stop(reason)
    finally:
        service.full.close()
        inbound.close()
        # A short linger lets the last replies out without hanging on a frontend that is gone.
        frontend.close(linger_ms=500)
        sched.close(linger_ms=500)
        ctx.term()
