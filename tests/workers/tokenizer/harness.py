"""What the tokenizer tests share: request bodies with images as data URLs, the server config, the ``Peer`` that plays
the frontend and the scheduler around a spawned tokenizer process, and shortcuts for in-process workers (a
request's TokenizedRequest, its refusal, its segments' inodes).
"""

from __future__ import annotations

import base64
import io
import json
import os
import time
from pathlib import Path
from typing import Any, TypeVar

from ipc.channels import PullSocket, PushSocket, new_context
from ipc.control import RequestFailed
from ipc.inbound import FrontendInbound, SchedulerInbound, TokenizerInbound
from ipc.launch import ipc_address
from ipc.prompts import MediaReady, TokenizedRequest
from ipc.requests import GenerateRequest
from ipc.shm import SHM_DIR
from ipc.stats import TokenizerStats
from server.config import ServerConfig
from tests.conftest import noise_image
from workers.engine.config import EngineConfig
from workers.tokenizer.worker import TokenizerWorker

M = TypeVar("M")
MODEL = "demo"


def png(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    noise_image(width, height, seed).save(buf, format="PNG")
    return buf.getvalue()


def jpeg(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    noise_image(width, height, seed).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def chat_body(images: list[bytes], **extra: Any) -> bytes:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "what differs?"}]
    for raw in images:
        url = f"data:image/png;base64,{base64.b64encode(raw).decode()}"
        parts.append({"type": "image_url", "image_url": {"url": url}})
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 8, **extra}
    return json.dumps(body).encode()


def server_config(model_dir: Path, launch_id: str) -> ServerConfig:
    engine = EngineConfig(model=str(model_dir), max_model_len=4096)
    return ServerConfig(engine=engine, launch_id=launch_id, served_model_name=MODEL, tokenizer_workers=1)


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class Peer:
    """The test plays frontend (PULL), scheduler (PULL) and the frontend's push to tok0."""

    def __init__(self, launch_id: str) -> None:
        self.ctx = ctx = new_context()
        address = {name: ipc_address(launch_id, name) for name in ("frontend", "sched", "tok0")}
        self.frontend = PullSocket[FrontendInbound](ctx, address["frontend"], FrontendInbound, True)
        self.sched = PullSocket[SchedulerInbound](ctx, address["sched"], SchedulerInbound, True)
        self.tok = PushSocket[TokenizerInbound](ctx, address["tok0"], TokenizerInbound, False)
        self.stats: list[TokenizerStats] = []

    def expect(self, kind: type[M], timeout_s: float = 30.0) -> M:
        """Next frontend message of `kind`, keeping TokenizerStats aside; anything else fails."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self.frontend.recv(int(left * 1000) + 1)
            if isinstance(msg, TokenizerStats):
                self.stats.append(msg)
            elif msg is not None:
                assert isinstance(msg, kind), msg
                return msg
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def scheduled(self, timeout_ms: int = 10_000) -> TokenizedRequest:
        """The next request handed to the scheduler, once all its pending images are reported ready."""
        msg = self.sched.recv(timeout_ms)
        assert isinstance(msg, TokenizedRequest), msg
        left = set(msg.pending)
        while left:
            ready = self.sched.recv(timeout_ms)
            assert isinstance(ready, MediaReady) and ready.rid == msg.rid, ready
            assert set(ready.hashes) <= left, (ready.hashes, left)
            for item in msg.items:  # published by the time it is reported
                if item.hash in ready.hashes and item.pixels is not None:
                    assert os.path.exists(shm_path(item.pixels.name))
            left -= set(ready.hashes)
        return msg

    def close(self) -> None:
        for sock in (self.frontend, self.sched, self.tok):
            sock.close()
        self.ctx.term()


def handle(worker: TokenizerWorker, rid: str, body: bytes) -> TokenizedRequest:
    result = worker.handle(GenerateRequest(rid, body, time.time()))
    assert isinstance(result, tuple), result
    return result[1]


def inodes(req: TokenizedRequest) -> list[int]:
    return [os.stat(shm_path(i.pixels.name)).st_ino for i in req.items if i.pixels]


def refusal_of(worker: TokenizerWorker, body: bytes) -> tuple[int, str | None, str | None]:
    result = worker.handle(GenerateRequest("refused", body, time.time()))
    assert isinstance(result, RequestFailed), result
    return result.status, result.code, result.param
