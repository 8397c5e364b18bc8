"""Launcher and supervisor: the main process of `glimpse serve`.

It sweeps the launch's shared memory, starts the children (model workers, scheduler, tokenizer
workers), waits for their ready acks, then serves HTTP in this process. It watches every child's
process sentinel on the event loop: if one dies, every in-flight request is failed at once, the
server stops and the launcher exits non-zero. SIGTERM or SIGINT drains in-flight requests and exits
0. Whatever happens, children are stopped and the launch's segments swept before it returns.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.process
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

import uvicorn

from ipc.launch import cleanup_launch_dir
from ipc.shm import sweep
from server.app import FrontendState, create_app
from server.config import ServerConfig

log = logging.getLogger("glimpse.launcher")


@dataclass
class Child:
    role: str
    index: int
    process: multiprocessing.process.BaseProcess

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"


def sd_notify(message: str) -> bool:
    """Tell systemd (Type=notify) about our state; a no-op unless NOTIFY_SOCKET is set."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("sd_notify(%s) failed: %s", message, exc)
        return False
    return True


def _child_entry(role: str, config: ServerConfig, index: int) -> None:
    """First code a child runs: die with the launcher, then hand over to the role's entry point."""
    _die_with_parent()
    # Until the role's own set-up runs: Ctrl-C and group SIGTERMs are the launcher's to act on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if role == "model":
        from workers.model import run_model_worker

        run_model_worker(config, index)
    elif role == "scheduler":
        from workers.scheduler import run_scheduler

        run_scheduler(config)
    elif role == "tokenizer":
        from workers.tokenizer import run_tokenizer

        run_tokenizer(config, index)
    else:
        raise ValueError(f"unknown role {role!r}")


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the launcher dies, so no child outlives a killed server
    (children ignore SIGTERM: the launcher drives every orderly stop)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def start_children(config: ServerConfig) -> list[Child]:
    ctx = multiprocessing.get_context("spawn")
    plan = [("model", r) for r in range(config.engine.tp_size)]
    plan += [("scheduler", 0)]
    plan += [("tokenizer", i) for i in range(config.tokenizer_workers)]
    children = []
    for role, index in plan:
        proc = ctx.Process(target=_child_entry, args=(role, config, index), name=f"glimpse-{role}-{index}")
        # Spawned children inherit the environment: the role in it lets operators (and tests) tell
        # the processes apart with ps/pgrep without asking the server.
        os.environ["GLIMPSE_ROLE"] = f"{role}[{index}]"
        try:
            proc.start()
        finally:
            os.environ.pop("GLIMPSE_ROLE", None)
        children.append(Child(role, index, proc))
        log.info("started %s[%d] pid %s", role, index, proc.pid)
    return children


def stop_children(children: list[Child], timeout: float) -> None:
    """Wait for children to exit after Shutdown; terminate, then kill, the ones that don't."""
    deadline = time.monotonic() + timeout
    for child in children:
        child.process.join(max(0.0, deadline - time.monotonic()))
    for sig_name, wait in (("terminate", 3.0), ("kill", 3.0)):
        alive = [c for c in children if c.process.is_alive()]
        if not alive:
            break
        for child in alive:
            log.warning("%s did not exit; %s", child.name, sig_name)
            getattr(child.process, sig_name)()
        for child in alive:
            child.process.join(wait)


class Launcher:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.children: list[Child] = []
        self.state: FrontendState | None = None
        self.server: uvicorn.Server | None = None
        self.failure: str | None = None
        self.stopping = False
        self._stop = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- supervision ----------------------------------------------------------------------------
    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        for child in self.children:
            loop.add_reader(child.process.sentinel, self._on_exit, loop, child)

    def _on_exit(self, loop: asyncio.AbstractEventLoop, child: Child) -> None:
        loop.remove_reader(child.process.sentinel)
        child.process.join(0)
        if self.stopping:
            return
        self.failure = f"{child.name} exited unexpectedly (exit code {child.process.exitcode})"
        log.error("%s; failing in-flight requests and shutting down", self.failure)
        if self.state is not None:
            self.state.fail_all(f"the server is shutting down: {self.failure}")
        self._request_stop()

    def _request_stop(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.should_exit = True

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
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.state = FrontendState(cfg)
        self.state.start()
        rendezvous = None
        if cfg.engine.tp_size > 1:
            from workers.model import host_rendezvous

            rendezvous, port = host_rendezvous()
            cfg = self.config = replace(cfg, dist_port=port)
        try:
            self.children = start_children(cfg)
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
        self.state.mark_ready()
        log.info("all children ready")
        return True

    async def _serve(self) -> None:
        assert self.state is not None
        cfg = self.config
        app = create_app(cfg, self.state)
        uv_config = uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            log_level=cfg.log_level,
            timeout_graceful_shutdown=int(cfg.drain_timeout_s),
            access_log=False,
        )
        self.server = uvicorn.Server(uv_config)
        if self._stop.is_set():
            return
        serve = asyncio.ensure_future(self.server.serve())
        while not self.server.started and not serve.done():
            await asyncio.sleep(0.02)
        if self.server.started:
            sd_notify("READY=1")
            log.info("serving %s on http://%s:%d", cfg.served_model_name, cfg.host, cfg.port)
        await serve
        if not self.failure:
            await self.state.drain(cfg.drain_timeout_s)

    async def _shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        cfg = self.config
        if self.state is not None:
            try:
                await self.state.send_shutdown(self.failure or "launcher stopping")
            finally:
                await self.state.close(linger_ms=500)
        for child in self.children:
            try:
                loop.remove_reader(child.process.sentinel)
            except (ValueError, OSError):
                pass
        await loop.run_in_executor(None, stop_children, self.children, 10.0)
        removed = sweep(cfg.launch_id)
        if removed:
            log.info("swept %d shm segments of launch %s", removed, cfg.launch_id)
        cleanup_launch_dir(cfg.launch_id)


def serve(config: ServerConfig, runner: Callable[[Any], int] | None = None) -> int:
    """Run the server until it is stopped; returns the process exit code."""
    import uvloop

    launcher = Launcher(config)
    return uvloop.run(launcher.run()) if runner is None else runner(launcher.run())
