"""A tokenizer process serving several requests at once: a dripping download delays only its own
request, an AbortRequest cancels the download (the server sees its connection close) and frees the
slot with an answer, and Shutdown is honoured in the middle of a download. Real process, sockets,
HTTP server on loopback."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipc.control import AbortRequest, ProcessReady, RequestFailed, Shutdown
from ipc.requests import GenerateRequest, RequestAccepted
from ipc.shm import ShmSegment
from ipc.stats import TokenizerStats
from tests.media_server import MediaServer
from tests.workers.tokenizer.harness import MODEL, Peer, png, server_config
from workers.tokenizer.process import run_tokenizer


def body(url: str | None, text: str = "what is it?") -> bytes:
    content: list[dict[str, object]] = [{"type": "text", "text": text}]
    if url is not None:
        content.append({"type": "image_url", "image_url": {"url": url}})
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}).encode()


def wait_until(cond: Callable[[], bool], timeout_s: float) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - start


def reported_depth(peer: Peer, depth: int, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = peer.frontend.recv(100)
        if isinstance(msg, TokenizerStats) and msg.queue_depth == depth:
            return True
        assert msg is None or isinstance(msg, TokenizerStats), msg
    return False


@pytest.fixture
def media() -> Iterator[MediaServer]:
    server = MediaServer(png(32, 32, seed=3))
    yield server
    server.close()


def test_slow_download_abort_and_shutdown(demo_model_dir: Path, launch_id: str, media: MediaServer) -> None:
    config = dataclasses.replace(
        server_config(demo_model_dir, launch_id), media_timeout_s=30.0, allow_private_media_addresses=("127.0.0.1",)
    )
    peer = Peer(launch_id)
    proc = multiprocessing.get_context("spawn").Process(target=run_tokenizer, args=(config, 0), daemon=True)
    proc.start()
    try:
        peer.expect(ProcessReady, timeout_s=120)
        peer.tok.send(GenerateRequest("warm", body(None), time.time()))
        peer.expect(RequestAccepted)
        peer.scheduled()

        # Two dripping downloads in flight; a text request and an image request pass them by.
        for rid in ("slow1", "slow2"):
            peer.tok.send(GenerateRequest(rid, body(media.url("/drip")), time.time()))
        wait_until(lambda: media.drips_open == 2, 10)
        start = time.monotonic()
        peer.tok.send(GenerateRequest("fast", body(None), time.time()))
        assert peer.expect(RequestAccepted).rid == "fast"
        assert time.monotonic() - start < 1.0
        peer.tok.send(GenerateRequest("img", body(media.url("/img.png")), time.time()))
        assert peer.expect(RequestAccepted).rid == "img"
        scheduled = [peer.scheduled(), peer.scheduled()]
        assert {r.rid for r in scheduled} == {"fast", "img"}
        # Not alone in the tokenizer (the downloads are in flight): its image was written before it left.
        assert [r.pending for r in scheduled if r.rid == "img"] == [[]]
        for name in [n for r in scheduled for n in r.shm_names]:
            assert ShmSegment.unlink(name)  # the scheduler's job, played by the test

        # The client of slow1 went away: its download stops and its slot is answered for.
        peer.tok.send(AbortRequest("slow1"))
        failed = peer.expect(RequestFailed, timeout_s=5)
        assert (failed.rid, failed.status) == ("slow1", 499)
        wait_until(lambda: media.drips_open == 1, 5)
        assert reported_depth(peer, 1)  # one request left in flight, by the tokenizer's own count

        # Shutdown mid-download: slow2 gets a 503 and the process exits promptly.
        t0 = time.monotonic()
        peer.tok.send(Shutdown("test over"))
        failed = peer.expect(RequestFailed, timeout_s=5)
        assert (failed.rid, failed.status) == ("slow2", 503)
        proc.join(10)
        assert proc.exitcode == 0 and time.monotonic() - t0 < 3.0
        wait_until(lambda: media.drips_open == 0, 5)
        assert peer.sched.recv(200) is None  # neither cancelled request reached the scheduler
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        peer.close()


def test_big_bodies_are_trimmed_after_once_idle_and_huge_ones_at_once() -> None:
    from workers.tokenizer.service import IdleTrim

    trim = IdleTrim(idle_s=10.0)
    # A chat's rounds back to back (7 MB bodies): no trim between them, nor while another request is in flight.
    assert not trim.finished(7 << 20, now=100.0, idle=True)
    assert not trim.due(now=105.0, idle=True)
    assert not trim.finished(7 << 20, now=106.0, idle=False)
    assert not trim.due(now=120.0, idle=False)
    assert not trim.finished(1 << 10, now=121.0, idle=True)  # the last one out: idle from 121
    assert not trim.due(now=130.0, idle=True)
    assert trim.due(now=131.0, idle=True)  # idle 10 s with a big body behind: trim, once
    assert not trim.due(now=200.0, idle=True)
    # Small bodies never ask for one; a huge body is trimmed after at once.
    assert not trim.finished(1 << 20, now=300.0, idle=True) and not trim.due(now=400.0, idle=True)
    assert trim.finished(20 << 20, now=500.0, idle=False)
    assert not trim.due(now=600.0, idle=True)
