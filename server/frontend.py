"""Frontend state: the launch's sockets, the requests in flight and the stats the children report.

Every chat request is a `Flight` whose queue the receive pump feeds; the HTTP handler is its only
reader and the only one that ends it (`finish`), so every exit path cleans up in one place.
Separate from server/app.py so the socket/routing side can be driven without HTTP and each file
stays small.

Launcher usage, all on the serving loop:
    state = FrontendState(config)   # binds PULL `frontend`, connects PUSH `tok{i}` and `sched`
    state.start()                   # the receive pump (create_app's lifespan calls it too)
    await state.wait_ready(t)       # scheduler + every tokenizer sent ProcessReady
    app = create_app(config, state) # serve with uvicorn
    state.fail_all(msg)             # a child died (other threads: fail_all_threadsafe)
    await state.drain(t); await state.send_shutdown(); await state.close(linger_ms=500)
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from ipc.channels import AsyncPullSocket, AsyncPushSocket, new_async_context
from ipc.launch import ipc_address
from ipc.messages import (
    AbortRequest,
    FrontendInbound,
    GenerateRequest,
    Msg,
    OutputBatch,
    ProcessReady,
    RequestAccepted,
    RequestFailed,
    RequestOutput,
    SchedulerStats,
    Shutdown,
    TokenizerStats,
)
from server.config import ServerConfig
from server.stats import Metrics, StatsBook

logger = logging.getLogger("glimpse.frontend")


class Disconnected:
    """Queue sentinel: the client went away (put by the handler's receive watcher)."""


DISCONNECTED = Disconnected()
FlightEvent = RequestAccepted | RequestFailed | RequestOutput | Disconnected
Outcome = Literal["ok", "failed", "aborted"]


@dataclass(eq=False)
class Flight:
    """One chat request between submission and its last byte."""

    rid: str
    worker: int
    arrival: float
    queue: asyncio.Queue[FlightEvent] = field(default_factory=asyncio.Queue)
    holds_slot: bool = True  # counted in its tokenizer's `outstanding` until the tokenizer answers


class FrontendState:
    """Sockets, in-flight requests and stats of the frontend process (one per launch)."""

    def __init__(self, config: ServerConfig, ctx: zmq.asyncio.Context | None = None) -> None:
        self.config = config
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else new_async_context()
        lid, n = config.launch_id, config.tokenizer_workers
        self.inbound = AsyncPullSocket[FrontendInbound](self._ctx, ipc_address(lid, "frontend"), FrontendInbound, True)
        # Senders are typed Msg: they only encode, and they carry several message kinds each.
        self.tokenizers: list[AsyncPushSocket[Msg]] = []
        self.scheduler: AsyncPushSocket[Msg] | None = None
        try:
            for name in [f"tok{i}" for i in range(n)]:
                self.tokenizers.append(AsyncPushSocket[Msg](self._ctx, ipc_address(lid, name), Msg, False))
            self.scheduler = AsyncPushSocket[Msg](self._ctx, ipc_address(lid, "sched"), Msg, False)
        except BaseException:
            self._close_sockets(0)
            raise
        self.flights: dict[str, Flight] = {}
        self.outstanding: list[int] = [0] * n  # per tokenizer: sent, not yet accepted or failed
        self.book = StatsBook()
        self.metrics = Metrics(self.book, self.outstanding)
        self.failed: str | None = None  # set when a child died: everything answers 503 from then on
        self.draining = False
        # Every ProcessReady, for the launcher to log or inspect; readiness itself is `wait_ready`.
        self.ready_messages: asyncio.Queue[ProcessReady] = asyncio.Queue()
        self._awaiting = {("scheduler", 0)} | {("tokenizer", i) for i in range(n)}
        self._ready, self._idle = asyncio.Event(), asyncio.Event()
        self._idle.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._rr = 0

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the receive pump on the running loop; idempotent."""
        if self._pump is None:
            self._loop = asyncio.get_running_loop()
            self._pump = self._loop.create_task(self.pump(), name="glimpse-frontend-pump")
            self._pump.add_done_callback(_log_crash)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def status(self) -> str:
        if self.failed is not None:
            return "failed"
        return "draining" if self.draining else "ok" if self.ready else "starting"

    def mark_ready(self) -> None:
        """Declare the backend ready without waiting for every ProcessReady."""
        self._ready.set()

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Return once the scheduler and every tokenizer sent ProcessReady; TimeoutError otherwise."""
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait for in-flight ones; False if some were still running."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def send_shutdown(self, reason: str = "") -> None:
        """Ask the scheduler and every tokenizer to exit (then close with a linger so it gets out)."""
        for sock in [self._sched, *self.tokenizers]:
            await sock.send(Shutdown(reason))

    async def close(self, linger_ms: int = 0) -> None:
        """Fail what is left, stop the pump, close the sockets (and the context if we made it)."""
        if self.flights:
            self.fail_all("server shutting down")
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        self._close_sockets(linger_ms)

    def _close_sockets(self, linger_ms: int) -> None:
        for sock in [self.inbound, *self.tokenizers, self.scheduler]:
            if sock is not None:
                sock.close(linger_ms)
        if self._own_ctx:
            self._ctx.term()

    @property
    def _sched(self) -> AsyncPushSocket[Msg]:
        assert self.scheduler is not None  # only None while __init__ is failing
        return self.scheduler

    # ---- inbound ----------------------------------------------------------------------------

    async def pump(self) -> None:
        """Route every inbound message until cancelled or the socket closes."""
        while True:
            try:
                msg = await self.inbound.recv()
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("undecodable message on the frontend socket: %s", exc)
                continue
            except zmq.ZMQError:
                if self.inbound.closed:
                    return
                raise
            try:
                self.dispatch(msg)
            except Exception:  # one bad message must not stop every request's answers
                logger.exception("failed to handle %s", type(msg).__name__)

    def dispatch(self, msg: FrontendInbound) -> None:
        if isinstance(msg, OutputBatch):
            for out in msg.outputs:
                flight = self.flights.get(out.rid)
                if flight is not None:  # unknown rid: the client already left
                    flight.queue.put_nowait(out)
        elif isinstance(msg, RequestAccepted | RequestFailed):
            flight = self.flights.get(msg.rid)
            if flight is not None:
                self._release_slot(flight)  # the tokenizer's part is over
                flight.queue.put_nowait(msg)
        elif isinstance(msg, SchedulerStats):
            self.book.on_scheduler(msg)
        elif isinstance(msg, TokenizerStats):
            self.book.on_tokenizer(msg)
        elif isinstance(msg, ProcessReady):
            self.ready_messages.put_nowait(msg)
            self._awaiting.discard(("scheduler", 0) if msg.role == "scheduler" else (msg.role, msg.index))
            if not self._awaiting:
                self._ready.set()

    # ---- requests ---------------------------------------------------------------------------

    def _pick_tokenizer(self) -> int:
        # Fewest outstanding; ties rotate so idle workers share the load.
        n = len(self.outstanding)
        self._rr = start = (self._rr + 1) % n
        return min(range(n), key=lambda k: (self.outstanding[k], (k - start) % n))

    async def submit(self, body: bytes) -> Flight:
        """Register a new flight and hand its body to the least busy tokenizer."""
        worker = self._pick_tokenizer()
        flight = Flight("chatcmpl-" + uuid.uuid4().hex, worker, time.time())
        self.flights[flight.rid] = flight
        self.outstanding[worker] += 1
        self.book.counters.in_flight += 1
        self._idle.clear()
        try:
            await self.tokenizers[worker].send(GenerateRequest(flight.rid, body, flight.arrival))
        except BaseException:
            self.finish(flight, "failed")
            raise
        return flight

    def _release_slot(self, flight: Flight) -> None:
        if flight.holds_slot:
            flight.holds_slot = False
            self.outstanding[flight.worker] -= 1

    def finish(self, flight: Flight, outcome: Outcome) -> None:
        """Forget a flight; idempotent. Late messages for its rid are dropped by `dispatch`."""
        if self.flights.pop(flight.rid, None) is None:
            return
        self._release_slot(flight)
        self.book.counters.record(outcome)
        if not self.flights:
            self._idle.set()

    def abort(self, rid: str) -> None:
        """Tell the scheduler to drop `rid` (valid even before the request reaches it)."""
        # Fire and forget: this runs in cleanup paths, possibly inside a cancelled task.
        task = asyncio.get_running_loop().create_task(self._sched.send(AbortRequest(rid)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_crash)

    def fail_all(self, message: str, status: int = 503) -> None:
        """Fail every in-flight request now and refuse new ones. Call on the serving loop."""
        if self.failed is None:
            self.failed = message
        for rid, flight in self.flights.items():
            flight.queue.put_nowait(RequestFailed(rid, status, message, type="server_error"))

    def fail_all_threadsafe(self, message: str, status: int = 503) -> None:
        """`fail_all` for callers outside the serving loop (e.g. a supervisor thread)."""
        if self._loop is None or self._loop.is_closed():
            self.fail_all(message, status)
        else:
            self._loop.call_soon_threadsafe(self.fail_all, message, status)


def _log_crash(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("frontend task %s failed", task.get_name(), exc_info=task.exception())
