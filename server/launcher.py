"""Launcher and supervisor: the main process of `glimpse serve`.

It sweeps the launch's shared memory (and that of earlier launches whose owner is gone), starts
the children (model workers, scheduler, tokenizer workers), waits for their ready acks, then serves
HTTP in this process. It watches every child's process sentinel on the event loop. A tokenizer that
dies is replaced (its unanswered requests get 503, the others go on): tokenizers hold no state
worth keeping. If a scheduler, a model worker or an encoder worker dies (of any replica, with --dp), every in-flight
request is failed at once and the launcher exits non-zero within a few seconds, killing what does not
stop on its own (the other replicas are told to stop, never left waiting). The
log says how a child ended, naming the signal (SIGKILL: most likely the OOM killer).

SIGTERM or SIGINT drains: the listener stays open, new requests and /health get a JSON 503
("draining"), requests in flight may finish until the drain deadline; those still running then end
with an error (an error event and [DONE] on a stream, a JSON 503 otherwise), and the launcher
exits 0. A second signal ends the drain at once. Whatever happens, children are stopped and the
launch's segments swept before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import replace
from types import FrameType
from typing import Any

import uvicorn
import zmq

from ipc.kv_event_publisher import KVEventPublisher
from ipc.launch import cleanup_launch_dir
from ipc.shm import sweep, sweep_dead_launches
from server.app import FrontendState, create_app
from server.children import (
    Child,
    EarlyChildren,
    describe_exit,
    raise_fd_limit,
    sd_notify,
    start_child,
    start_children,
    stop_children,
    worker_plan,
)
from server.config import ServerConfig
from server.http_guard import HttpLimits, guarded_protocol
from workers.common.full_collections import FullCollections
from workers.common.memory import tune_malloc
from workers.common.proc import GcWatch, freeze_heap, keep_kernel_caches
from workers.common.reasoning_channels import check_markers

log = logging.getLogger("glimpse.launcher")

RESPAWN_LIMIT = 5  # deaths of one tokenizer within RESPAWN_WINDOW_S after which it is not replaced
RESPAWN_WINDOW_S = 60.0
CLEAN_EXIT_S = 10.0  # after Shutdown, how long children get to exit before SIGKILL
# The same after a child crashed: the server must be gone within ~3 s. Model and encoder workers are not waited for then (after
# a crash nothing tells them to stop, and they hold nothing the launcher's sweep does not clean up); tokenizers, told
# by Shutdown, need ~1 s to exit (torch's teardown), so the wait only caps a slow one.
CRASH_EXIT_S = 0.5
FD_RESERVE = 256  # descriptors kept for sockets, shm and files besides HTTP connections
# How often the frontend looks whether it is idle: its full collections wait for that.
_GC_TICK_S = 0.25


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The launcher owns SIGINT/SIGTERM: it drains with the listener open (new requests get a
        # 503) before uvicorn stops; uvicorn's own handler would close the listener at once.
        yield


class Launcher:
    def __init__(self, config: ServerConfig, early: EarlyChildren | None = None) -> None:
        self.config = config
        self.early = early  # children started before the config (run_serve), waiting for it
        self.children: list[Child] = []
        self.state: FrontendState | None = None
        self.server: uvicorn.Server | None = None
        self.failure: str | None = None
        self.stopping = False
        self._stop = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deaths: dict[int, deque[float]] = {}  # tokenizer index -> recent death times
        self.kv_events: KVEventPublisher | None = None  # every replica's KV-cache events (--kv-events-endpoint)
        self._zmq: zmq.Context[Any] | None = None
        self._frozen = 0  # objects the start-up freeze took out of the collector's reach (frontend_gc)

    # ---- supervision ----------------------------------------------------------------------------
    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        for child in self.children:
            loop.add_reader(child.process.sentinel, self._on_exit, loop, child)

    def _on_exit(self, loop: asyncio.AbstractEventLoop, child: Child) -> None:
        loop.remove_reader(child.process.sentinel)
        # The sentinel fires as the process exits; the exit status may take a moment to be reapable.
        child.process.join(1.0)
        if self.stopping:
            return
        how = f"{child.name} (pid {child.process.pid}) {describe_exit(child.process.exitcode)}"
        if child.role == "tokenizer" and self._may_respawn(child.index):
            log.error("%s; failing its unanswered requests and starting a new one", how)
            if self.state is not None:
                self.state.tokenizer_down(
                    child.index, "Service unavailable: the tokenizer preparing this request died; retry."
                )
            new = start_child(self.config, child.role, child.index)
            self.children[self.children.index(child)] = new
            loop.add_reader(new.process.sentinel, self._on_exit, loop, new)
            return
        self.failure = how if child.role != "tokenizer" else f"{how}, {RESPAWN_LIMIT} times in {RESPAWN_WINDOW_S:.0f} s"
        log.error("%s; failing in-flight requests and shutting down", self.failure)
        if self.state is not None:
            self.state.fail_all(f"the server is shutting down: {self.failure}")
        self._request_stop()

    def _may_respawn(self, index: int) -> bool:
        now = time.monotonic()
        deaths = self._deaths.setdefault(index, deque())
        deaths.append(now)
        while deaths and deaths[0] < now - RESPAWN_WINDOW_S:
            deaths.popleft()
        return len(deaths) < RESPAWN_LIMIT

    def _request_stop(self) -> None:
        if self._stop.is_set() and self.state is not None and self.failure is None:
            log.warning("second stop request: ending the drain now")
            self.state.fail_in_flight("The server is shutting down.")
        self._stop.set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log.info("received %s; draining", signal.Signals(signum).name)
        # call_soon_threadsafe writes the loop's self-pipe, so a loop asleep in epoll wakes up now.
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._request_stop)

    # ---- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> int:
        cfg = self.config
        loop = self._loop = asyncio.get_running_loop()
        removed = sweep(cfg.launch_id)
        if removed:
            log.warning("swept %d stale segments of launch %s", removed, cfg.launch_id)
        for dead, count in sweep_dead_launches().items():
            log.warning("swept %d segments and the sockets of launch %s, whose launcher is gone", count, dead)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.state = FrontendState(cfg)
        self.state.start()
        rendezvous = None
        if cfg.engine.tp_size > 1:
            from workers.model.process import host_rendezvous

            rendezvous, port = host_rendezvous()
            cfg = self.config = replace(cfg, dist_port=port)
        try:
            if cfg.kv_events_endpoint and not self._open_kv_events():
                return 1
            self.children = start_children(cfg, self.early)
            self._watch(loop)
            if not await self._wait_ready():
                return 1
            await self._serve()
            return 1 if self.failure else 0
        finally:
            self.stopping = True
            sd_notify("STOPPING=1")
            await self._shutdown(loop)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            del rendezvous  # the ranks are gone: stop serving the store

    def _open_kv_events(self) -> bool:
        """The KV-event publisher, before the schedulers that feed it (a taken port fails the launch here)."""
        cfg = self.config
        self._zmq = zmq.Context()
        try:
            self.kv_events = KVEventPublisher(
                self._zmq, cfg.launch_id, cfg.kv_events_endpoint, cfg.kv_events_topic,
                cfg.kv_events_replay_endpoint, cfg.kv_events_buffer_steps,
            ).start()
        except zmq.ZMQError as exc:
            self.failure = f"cannot open the KV-event sockets ({cfg.kv_events_endpoint}): {exc}"
            log.error("%s", self.failure)
            return False
        replay = f", replay on {cfg.kv_events_replay_endpoint}" if cfg.kv_events_replay_endpoint else ""
        log.info("publishing KV-cache events on %s (topic %s%s)", cfg.kv_events_endpoint, cfg.kv_events_topic, replay)
        return True

    def _close_kv_events(self) -> None:
        """After the schedulers exited: their last batches (AllBlocksCleared) go out first."""
        if self.kv_events is not None:
            self.kv_events.stop(linger_ms=0 if self.failure else 200)
            self.kv_events = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    async def _wait_ready(self) -> bool:
        assert self.state is not None
        ready = asyncio.ensure_future(self.state.wait_ready(self.config.ready_timeout_s))
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not ready.done():
            ready.cancel()
            log.error("start-up aborted: %s", self.failure or "stop requested")
            return False
        if ready.exception() is not None:
            self.failure = f"children not ready after {self.config.ready_timeout_s:.0f} s"
            log.error(self.failure)
            return False
        self._frozen = freeze_heap(log)
        self.state.mark_ready()
        log.info("all children ready")
        return True

    def _http_limits(self) -> HttpLimits:
        cfg = self.config
        fds = raise_fd_limit()
        connections = min(cfg.http_max_connections, max(16, fds - FD_RESERVE))
        if connections < cfg.http_max_connections:
            log.warning(
                "open-file limit %d: serving at most %d HTTP connections, not %d (raise `ulimit -n`)",
                fds, connections, cfg.http_max_connections,
            )
        return HttpLimits(connections, cfg.http_header_timeout_s, cfg.http_idle_timeout_s, cfg.http_max_header_bytes)

    async def _serve(self) -> None:
        assert self.state is not None
        cfg = self.config
        app = create_app(cfg, self.state)
        uv_config = uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            log_level=cfg.log_level,
            timeout_graceful_shutdown=2,  # only once drained: what is left are responses being written
            access_log=False,
            http=guarded_protocol(self._http_limits()),
            timeout_keep_alive=max(1, round(cfg.http_keep_alive_timeout_s)),
        )
        self.server = _Server(uv_config)
        if self._stop.is_set():
            return
        serve = asyncio.ensure_future(self.server.serve())
        while not self.server.started and not serve.done():
            await asyncio.sleep(0.02)
        if self.server.started:
            sd_notify("READY=1")
            log.info("serving %s on http://%s:%d", cfg.served_model_name, cfg.host, cfg.port)
        collector = asyncio.ensure_future(self._collect_when_idle())
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({serve, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        collector.cancel()
        if not serve.done():
            await self._drain()
            self.server.should_exit = True
        await serve

    async def _collect_when_idle(self) -> None:
        """The frontend's full collections off the request path (workers/common/full_collections.py): this event
        loop writes every stream's chunks, so one collection here holds them all back."""
        assert self.state is not None
        state, watch, seen = self.state, GcWatch(frozen=self._frozen), -1
        full = FullCollections(watch)
        state.book.frontend_gc = watch  # /admin/stats frontend_gc
        try:
            while True:
                await asyncio.sleep(_GC_TICK_S)
                now, busy = time.monotonic(), bool(state.flights)
                if busy or state.book.counters.total != seen:
                    seen = state.book.counters.total
                    full.worked(now, not busy)
                full.poll(now, not busy)
        finally:  # cancelled once serving ends
            full.close()
            watch.close()

    async def _drain(self) -> None:
        """Let requests in flight finish while the listener answers new ones with 503; past the
        deadline (or after a crash, at once) fail what is left and give the answers a moment to go out."""
        assert self.state is not None
        state, timeout = self.state, self.config.drain_timeout_s
        if self.failure is None:
            sd_notify("STOPPING=1")
            log.info("draining %d requests in flight (up to %.0f s)", len(state.flights), timeout)
            if not await state.drain(timeout):
                log.warning("drain deadline passed: failing %d requests still running", len(state.flights))
                state.fail_in_flight("The server is shutting down: the request did not finish in time.")
        else:
            state.draining = True
        await state.wait_idle(1.0)

    async def _shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        cfg = self.config
        for child in self.children:
            try:
                loop.remove_reader(child.process.sentinel)
            except (ValueError, OSError):
                pass
        wait = CRASH_EXIT_S if self.failure else CLEAN_EXIT_S
        try:
            if self.state is not None:
                await self.state.send_shutdown(self.failure or "launcher stopping")
            # The frontend's sockets stay open until the children are gone: their last sends are
            # delivered at once instead of lingering on a closed peer, so they exit without delay.
            if self.failure:
                for child in self.children:
                    if child.role in ("model", "encoder") and child.process.is_alive():
                        child.process.kill()
            await loop.run_in_executor(None, stop_children, self.children, wait)
        finally:
            if self.state is not None:
                await self.state.close(linger_ms=0)
            self._close_kv_events()
        removed = sweep(cfg.launch_id)
        if removed:
            log.info("swept %d shm segments of launch %s", removed, cfg.launch_id)
        cleanup_launch_dir(cfg.launch_id)


def serve(
    config: ServerConfig, runner: Callable[[Any], int] | None = None, early: EarlyChildren | None = None
) -> int:
    """Run the server until it is stopped; returns the process exit code. ``early``: children already started
    (``start_early``), which take ``config`` instead of being spawned; the caller closes it."""
    import uvloop

    try:
        check_markers(config.reasoning_parser, config.engine.model)  # before any child starts: one line, not a crash
    except ValueError as exc:
        raise SystemExit(f"glimpse serve: {exc}") from None
    tune_malloc()  # the frontend's bodies and answers come in all sizes too (workers/common/memory.py)
    keep_kernel_caches()  # before any child starts: they inherit it
    launcher = Launcher(config, early)
    return uvloop.run(launcher.run()) if runner is None else runner(launcher.run())


def start_early(tp: int, dp: int, encoder_workers: int = 0, shared_encoders: bool = False) -> EarlyChildren:
    """The model workers (and encoder workers) of a launch of ``tp`` x ``dp`` ranks, started before its config is
    built (children.py's EarlyChildren says why) with the environment every child gets. The counts are the flags'
    as given (ServerConfig.encoder_count's rule): a launch whose config refuses them kills these children."""
    keep_kernel_caches()
    dp = max(1, dp)
    return EarlyChildren(worker_plan(max(1, tp) * dp, max(0, encoder_workers) * (1 if shared_encoders else dp)))
