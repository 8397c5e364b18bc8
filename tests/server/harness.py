"""Test harness for the HTTP frontend: uvicorn in a thread serving create_app, and the children's
ends of the frontend's ZMQ sockets (tokenizers and scheduler) driven by the test itself."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import openai
import pytest
import uvicorn
import uvloop

from ipc.channels import PullSocket, PushSocket, new_context
from ipc.control import AbortRequest, Msg, ProcessReady
from ipc.inbound import SchedulerInbound, TokenizerInbound
from ipc.launch import cleanup_launch_dir, ipc_address
from ipc.outputs import OutputBatch, RequestOutput
from ipc.requests import GenerateRequest, RequestAccepted
from server.app import create_app
from server.config import ServerConfig
from server.frontend import FrontendState
from server.http_guard import HttpLimits, guarded_protocol

API_KEY = "sk-test-key"
# The launcher serves on uvloop; nothing in the app may depend on that.
LOOPS = pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
T = TypeVar("T")


class Peers:
    """The children's ends of the frontend's sockets, driven by the test."""

    def __init__(self, config: ServerConfig) -> None:
        self.ctx = new_context()
        lid = config.launch_id
        self.toks = [
            PullSocket[TokenizerInbound](self.ctx, ipc_address(lid, f"tok{i}"), TokenizerInbound, True)
            for i in range(config.tokenizer_workers)
        ]
        self.sched = PullSocket[SchedulerInbound](self.ctx, ipc_address(lid, "sched"), SchedulerInbound, True)
        self.out = PushSocket[Msg](self.ctx, ipc_address(lid, "frontend"), Msg, False)

    def request(self, worker: int = 0, timeout_s: float = 5.0) -> GenerateRequest:
        msg = self.toks[worker].recv(int(timeout_s * 1000))
        assert isinstance(msg, GenerateRequest), msg
        return msg

    def accept(self, req: GenerateRequest, prompt_tokens: int = 5, endpoint: str = "chat") -> None:
        body = json.loads(bytes(req.body))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.out.send(RequestAccepted(req.rid, bool(body.get("stream")), include_usage, body["model"], prompt_tokens, 0,
                                      endpoint=endpoint))  # fmt: skip

    def output(self, rid: str, text: str, finish: str | None, completion_tokens: int, prompt_tokens: int = 5) -> None:
        self.out.send(OutputBatch([RequestOutput(rid, text, [1], finish, prompt_tokens, completion_tokens)]))

    def hello(self, rid: str) -> None:
        self.output(rid, "Hel", None, 1)
        self.output(rid, "lo", "stop", 2)

    def abort(self, timeout_s: float = 5.0) -> AbortRequest:
        msg = self.sched.recv(int(timeout_s * 1000))
        assert isinstance(msg, AbortRequest), msg
        return msg

    def close(self) -> None:
        socks: list[PullSocket[Any] | PushSocket[Any]] = [*self.toks, self.sched, self.out]
        for sock in socks:
            sock.close()
        self.ctx.term()


class Served:
    """create_app under uvicorn in a thread with its own uvloop loop, as the launcher serves it."""

    def __init__(self, config: ServerConfig, ready: bool, loop: str, http_limits: HttpLimits | None = None) -> None:
        self.config = config
        self.loop_factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
        self.state = FrontendState(config)
        self.peers = Peers(config)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        # With limits: the launcher's guarded protocol; without: uvicorn's own, as before.
        http: Any = guarded_protocol(http_limits) if http_limits is not None else "auto"
        self.server = uvicorn.Server(
            uvicorn.Config(create_app(config, self.state), log_level="warning", http=http)
        )
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, args=(sock,), daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, what="uvicorn start")
        self.http = httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=10)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=10)
        self.pool = ThreadPoolExecutor(4)
        if ready:
            self.peers.out.send(ProcessReady("scheduler", 0, 1))
            for i in range(config.tokenizer_workers):
                self.peers.out.send(ProcessReady("tokenizer", i, 1))
            wait_for(lambda: self.http.get("/health").status_code == 200, what="health")

    def _run(self, sock: socket.socket) -> None:
        with asyncio.Runner(loop_factory=self.loop_factory) as runner:
            self.loop = runner.get_loop()
            runner.run(self._main(sock))

    async def _main(self, sock: socket.socket) -> None:
        try:
            await self.server.serve(sockets=[sock])
        finally:
            await self.state.close()

    def bg(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        return self.pool.submit(fn, *args, **kwargs)

    def on_loop(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stats(self) -> dict[str, Any]:
        response = self.http.get("/admin/stats")
        assert response.status_code == 200
        result: dict[str, Any] = response.json()
        return result

    def stop(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.http.close()
        self.client.close()
        self.server.should_exit = True
        self.thread.join(10)
        self.peers.close()
        cleanup_launch_dir(self.config.launch_id)


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def check_clean(served: Served) -> None:
    """Every exit path (answer, error, disconnect, fail_all) must have forgotten its rid."""
    wait_for(lambda: not served.state.flights, what="flights to be cleaned up")
    # A tokenizer slot is freed by the tokenizer's (possibly late) answer, which the frontend's pump handles on its
    # own loop: give it the same time rather than reading the count at once.
    wait_for(lambda: all(n == 0 for n in served.state.outstanding), what="tokenizer slots to be freed")


ServeFactory = Callable[..., Served]
