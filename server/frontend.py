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
    state.tokenizer_down(i, msg)    # tokenizer i died: its unanswered requests get 503, the rest go on
    await state.drain(t); await state.send_shutdown(); await state.close(linger_ms=500)

With ``--dp`` > 1 the tokenizers hand prepared requests back here (``RouteRequest``) and the router
(server/router.py) forwards each to one replica's scheduler; aborts then go to that replica alone.

Routing counts what each tokenizer really has in hand: a request holds its tokenizer's slot from the
moment it is sent until that tokenizer answers (RequestAccepted or RequestFailed), also after its
client went away, since the tokenizer may still be working on it until our AbortRequest reaches it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from ipc import endpoints
from ipc.channels import AsyncPushSocket, new_async_context
from ipc.control import AbortRequest, Msg, ProcessReady, RequestFailed, Shutdown
from ipc.inbound import FrontendInbound
from ipc.outputs import OutputBatch, RequestOutput
from ipc.requests import RENDER_ENDPOINTS, GenerateRequest, RequestAccepted, RequestRendered, RouteRequest
from ipc.stats import SchedulerStats, TokenizerStats
from server.config import ServerConfig
from server.metrics import Metrics
from server.pool_stats import PoolCollector
from server.router import Router
from server.stats import StatsBook
from workers.common.step_trace import StepTrace

logger = logging.getLogger("glimpse.frontend")
_ABORTS_KEPT = 65536  # rids remembered for an abort until their RouteRequest comes (old ones fall out)


class Disconnected:
    """Queue sentinel: the client went away (put by the handler's receive watcher)."""


DISCONNECTED = Disconnected()
FlightEvent = RequestAccepted | RequestFailed | RequestOutput | RequestRendered | Disconnected
Outcome = Literal["ok", "failed", "aborted"]


@dataclass(eq=False)
class Flight:
    """One chat request between submission and its last byte."""

    rid: str
    worker: int
    arrival: float
    queue: asyncio.Queue[FlightEvent] = field(default_factory=asyncio.Queue)
    replica: int = 0  # the scheduler it went to; -1 while a --dp router has not chosen one yet
    render: bool = False  # a render (vLLM's /render routes): answered by its tokenizer, in no request counter


class NoTokenizer(Exception):
    """Every tokenizer is down (restarting): the request cannot be taken now."""


class FrontendState:
    """Sockets, in-flight requests and stats of the frontend process (one per launch)."""

    def __init__(self, config: ServerConfig, ctx: zmq.asyncio.Context | None = None) -> None:
        self.config = config
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else new_async_context()
        lid, n = config.launch_id, config.tokenizer_workers
        self.inbound = endpoints.apull(self._ctx, lid, endpoints.FRONTEND)
        # Senders are typed Msg: they only encode, and they carry several message kinds each.
        self.tokenizers: list[AsyncPushSocket[Msg]] = []
        self.scheduler: AsyncPushSocket[Msg] | None = None
        self.dp = max(1, config.dp_size)
        self.schedulers: list[AsyncPushSocket[Msg]] = []  # one per replica; ``scheduler`` is replica 0's
        try:
            for i in range(n):
                self.tokenizers.append(AsyncPushSocket[Msg](self._ctx, endpoints.TOKENIZER.address(lid, i), Msg, False))
            for r in range(self.dp):
                self.schedulers.append(AsyncPushSocket[Msg](self._ctx, endpoints.SCHEDULER.address(lid, r), Msg, False))
            self.scheduler = self.schedulers[0]
        except BaseException:
            self._close_sockets(0)
            raise
        self.flights: dict[str, Flight] = {}
        self.trace = StepTrace("frontend")
        self.slots: dict[str, int] = {}  # rid -> the tokenizer working on it (sent, not yet answered)
        self.outstanding: list[int] = [0] * n  # per tokenizer: its slots (the same list Metrics reads)
        self.tokenizer_up: list[bool] = [True] * n  # False from its death until its successor is ready
        self.book = StatsBook()
        self.metrics = Metrics(self.book, self.outstanding)
        self.router = Router(
            self.dp, config.engine.block_size, config.engine.max_num_seqs, config.dp_routing == "affinity"
        )
        self.book.routing, self.book.tp_size = self.router.views, config.engine.tp_size
        self.book.kv_cache_dtype = config.engine.kv_dtype_name()
        pool = PoolCollector(self.book, self.router.views, self.outstanding, config.served_model_name,
                             config.engine.block_size, self.book.kv_cache_dtype)
        self.metrics.registry.register(pool)
        # Requests to drop as soon as their RouteRequest arrives (aborted before a replica was chosen).
        self._abort_on_route: OrderedDict[str, None] = OrderedDict()
        self.failed: str | None = None  # set when a child died: everything answers 503 from then on
        self.draining = False
        # Every ProcessReady, for the launcher to log or inspect; readiness itself is `wait_ready`.
        self.ready_messages: asyncio.Queue[ProcessReady] = asyncio.Queue()
        self._awaiting = {("scheduler", r) for r in range(self.dp)} | {("tokenizer", i) for i in range(n)}
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
        for sock in [*self.schedulers, *self.tokenizers]:
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
        self.inbound.close(linger_ms)
        for sock in [*self.tokenizers, *self.schedulers]:
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
        elif isinstance(msg, RouteRequest):
            self._route(msg)
        elif isinstance(msg, RequestAccepted | RequestRendered | RequestFailed):
            self._release_slot(msg.rid)  # the tokenizer's part is over (also for a forgotten flight)
            if isinstance(msg, RequestFailed):
                self._abort_on_route.pop(msg.rid, None)  # refused: no RouteRequest will follow
            flight = self.flights.get(msg.rid)
            if flight is not None:
                flight.queue.put_nowait(msg)
        elif isinstance(msg, SchedulerStats):
            self.book.on_scheduler(msg)
            self.router.set_capacity(msg.replica, msg.kv_blocks_total, msg.kv_host_cache_slots_total)
        elif isinstance(msg, TokenizerStats):
            self.book.on_tokenizer(msg)
        elif isinstance(msg, ProcessReady):
            self.ready_messages.put_nowait(msg)
            if msg.role == "tokenizer" and 0 <= msg.index < len(self.tokenizer_up):
                self.tokenizer_up[msg.index] = True  # a restarted tokenizer takes requests again
            self._awaiting.discard((msg.role, msg.index))
            if not self._awaiting:
                self._ready.set()

    # ---- requests ---------------------------------------------------------------------------

    def _pick_tokenizer(self) -> int:
        # Fewest outstanding among the live ones; ties rotate so idle workers share the load.
        n = len(self.outstanding)
        self._rr = start = (self._rr + 1) % n
        live = [k for k in range(n) if self.tokenizer_up[k]]
        if not live:
            raise NoTokenizer
        return min(live, key=lambda k: (self.outstanding[k], (k - start) % n))

    async def submit(self, body: bytes, endpoint: str = "chat", started: float = 0.0) -> Flight:
        """Register a new flight and hand its body to the least busy tokenizer; NoTokenizer if none
        is up. ``endpoint``: "chat" or "completion" (the body's kind, and its answer's id prefix); ``started``: the
        handler's time.monotonic() before it read the body, for the step trace."""
        worker = self._pick_tokenizer()
        prefix = ("cmpl-" if endpoint.startswith(("completion", "generate", "vllm_generate"))
                  else "resp_" if endpoint == "responses" else "msg_" if endpoint == "messages"
                  else "chatcmpl-")  # fmt: skip
        flight = Flight(prefix + uuid.uuid4().hex, worker, time.time(), replica=0 if self.dp == 1 else -1,
                        render=endpoint in RENDER_ENDPOINTS)
        self.flights[flight.rid] = flight
        self.trace.event("submit", rid=flight.rid, bytes=len(body), read=started)
        self.slots[flight.rid] = worker
        self.outstanding[worker] += 1
        self.book.counters.in_flight += 1
        self._idle.clear()
        try:
            await self.tokenizers[worker].send(GenerateRequest(flight.rid, memoryview(body), flight.arrival, endpoint))
        except BaseException:
            self._release_slot(flight.rid)  # never sent: no answer will come to free it
            self.finish(flight, "failed")
            raise
        return flight

    def _route(self, msg: RouteRequest) -> None:
        """A prepared request (--dp > 1): forward it, as the tokenizer encoded it, to the router's replica."""
        flight, dropped = self.flights.get(msg.rid), msg.rid in self._abort_on_route
        self._abort_on_route.pop(msg.rid, None)
        if flight is None or dropped or flight.replica >= 0:
            # Nobody waits for its answer, but its shm names must reach a scheduler (the one process that
            # unlinks them): deliver it with its abort right behind.
            self._send_later(self.schedulers[self.router.least_busy()], bytes(msg.request), AbortRequest(msg.rid))
            return
        flight.replica = self.router.route(msg)
        self._send_later(self.schedulers[flight.replica], bytes(msg.request))

    def _abort_later(self, rid: str) -> None:
        self._abort_on_route[rid] = None
        if len(self._abort_on_route) > _ABORTS_KEPT:  # rids whose tokenizer died before routing them
            self._abort_on_route.popitem(last=False)

    def _release_slot(self, rid: str) -> None:
        worker = self.slots.pop(rid, None)
        if worker is not None:
            self.outstanding[worker] -= 1

    def finish(self, flight: Flight, outcome: Outcome) -> None:
        """Forget a flight; idempotent. Late messages for its rid are dropped by `dispatch`. Its
        tokenizer slot stays taken until that tokenizer answers."""
        if self.flights.pop(flight.rid, None) is None:
            return
        if self.dp > 1 and flight.replica >= 0:
            self.router.done(flight.replica)
        if flight.render:
            self.book.counters.in_flight -= 1  # in flight like any request, counted as none (RequestCounters)
        else:
            self.book.counters.record(outcome)
        if not self.flights:
            self._idle.set()

    def abort(self, rid: str) -> None:
        """Tell the scheduler to drop `rid` (valid even before the request reaches it), and its
        tokenizer too while that one still has it (it stops downloading and answers, freeing the slot)."""
        flight = self.flights.get(rid)
        if flight is None:  # not ours to track any more: whichever replica has it drops it
            for sock in self.schedulers:
                self._send_later(sock, AbortRequest(rid))
        elif flight.replica >= 0:
            self._send_later(self.schedulers[flight.replica], AbortRequest(rid))
        else:
            self._abort_later(rid)  # no replica yet: drop it when its RouteRequest comes
        if (worker := self.slots.get(rid)) is not None:
            self._send_later(self.tokenizers[worker], AbortRequest(rid))

    def _send_later(self, sock: AsyncPushSocket[Msg], *msgs: Msg | bytes) -> None:
        # Fire and forget: this runs in cleanup paths, possibly inside a cancelled task. One task sends
        # them all, in order.
        task = asyncio.get_running_loop().create_task(_send_all(sock, msgs))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_crash)

    def tokenizer_down(self, index: int, message: str) -> None:
        """Tokenizer `index` died: route around it until its successor's ProcessReady, and fail the
        requests it had not answered with 503 (others, on other tokenizers or already with the
        scheduler, go on). The scheduler is told to drop them in case one got out before the death."""
        self.tokenizer_up[index] = False
        for rid in [rid for rid, worker in self.slots.items() if worker == index]:
            self._release_slot(rid)
            if self.dp == 1:
                self._send_later(self._sched, AbortRequest(rid))
            else:
                self._abort_later(rid)
            if (flight := self.flights.get(rid)) is not None:
                flight.queue.put_nowait(RequestFailed(rid, 503, message, type="server_error", code="service_unavailable"))

    def fail_in_flight(self, message: str, status: int = 503) -> None:
        """Fail every request in flight now (the drain deadline); the children are told to drop them."""
        for rid in self.flights:
            self.abort(rid)
        self._fail_flights(message, status)

    def _fail_flights(self, message: str, status: int) -> None:
        for rid, flight in self.flights.items():
            flight.queue.put_nowait(RequestFailed(rid, status, message, type="server_error", code="service_unavailable"))

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no flight is left (every handler wrote its last byte); False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def fail_all(self, message: str, status: int = 503) -> None:
        """Fail every in-flight request now and refuse new ones. Call on the serving loop."""
        if self.failed is None:
            self.failed = message
        # The server is going down: nothing is routed any more, so no slot needs its answer.
        self.slots.clear()
        self.outstanding[:] = [0] * len(self.outstanding)
        self._fail_flights(message, status)

    def fail_all_threadsafe(self, message: str, status: int = 503) -> None:
        """`fail_all` for callers outside the serving loop (e.g. a supervisor thread)."""
        if self._loop is None or self._loop.is_closed():
            self.fail_all(message, status)
        else:
            self._loop.call_soon_threadsafe(self.fail_all, message, status)


async def _send_all(sock: AsyncPushSocket[Msg], msgs: tuple[Msg | bytes, ...]) -> None:
    for msg in msgs:
        await (sock.send_bytes(msg) if isinstance(msg, bytes) else sock.send(msg))


def _log_crash(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("frontend task %s failed", task.get_name(), exc_info=task.exception())

