"""Crashes and shutdown against the real server: a tokenizer killed under load is replaced while the
others keep serving; a scheduler killed takes the server down within 3 s, the log naming the signal;
a killed launcher leaves no shared memory (its scheduler sweeps) and a later start sweeps what a dead
launch left; retained segments expire; a drain past its deadline ends streams with an error event
and [DONE]."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from ipc.launch import ipc_address, launch_dir, new_launch_id
from ipc.shm import ShmSegment, list_segments, segment_name
from tests.ipc.test_shm import _dead_pid
from tests.server.live import LiveServer, data_url, image_message, png_bytes

ARGS = ("--max-model-len", "2048", "--tokenizer-workers", "2")


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped counts: it runs no code and holds no segment open)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def post(server: LiveServer, i: int, **extra: object) -> httpx.Response:
    messages = image_message(f"Page {i}?", [data_url(png_bytes(80 + i % 7, 60, seed=i))])
    body = {"model": "demo", "messages": messages, "max_tokens": 4, **extra}
    return httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60)


def test_tokenizer_killed_under_load_is_replaced_then_drain_past_deadline(demo_model_dir: Path) -> None:
    server = LiveServer(demo_model_dir, *ARGS, "--drain-timeout", "1")
    try:
        victim, survivor = server.child_pids("tokenizer")
        codes: list[int] = []
        stop = threading.Event()

        def load(worker: int) -> None:
            i = worker * 1000
            while not stop.is_set():
                i += 1
                codes.append(post(server, i).status_code)

        with ThreadPoolExecutor(6) as pool:
            for w in range(6):
                pool.submit(load, w)
            wait_until(lambda: len(codes) >= 6, 30, "load")
            os.kill(victim, signal.SIGKILL)
            killed_at = len(codes)
            wait_until(lambda: len(codes) >= killed_at + 12, 30, "requests after the kill")
            stop.set()
        # Requests the dead tokenizer had in hand got 503; everything else was served.
        assert set(codes) <= {200, 503} and codes.count(503) <= 6, codes
        assert codes[-6:].count(200) >= 3, codes
        wait_until(lambda: len(server.child_pids("tokenizer")) == 2, 60, "a new tokenizer")
        assert victim not in server.child_pids("tokenizer") and survivor in server.child_pids("tokenizer")
        wait_until(lambda: httpx.get(server.base + "/health").status_code == 200, 10, "health")
        assert all(post(server, 10_000 + i).status_code == 200 for i in range(6))
        assert "tokenizer[0]" in server.output() and "SIGKILL" in server.output()

        # Drain past its deadline: a stream and a plain request that cannot finish within 1 s.
        long = {"max_tokens": 1900, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(post, server, 1, **long)
            with httpx.stream("POST", server.base + "/v1/chat/completions", timeout=60, json={
                "model": "demo", "messages": [{"role": "user", "content": "go on"}], "stream": True, **long,
            }) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")
                server.proc.send_signal(signal.SIGTERM)
                time.sleep(0.2)
                # Draining: the listener is still open, new work gets a JSON 503, /health says so.
                refused = post(server, 2)
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "service_unavailable"
                health = httpx.get(server.base + "/health")
                assert health.status_code == 503 and health.json()["status"] == "draining"
                events = [line for line in lines if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert "error" in json.loads(events[-2].removeprefix("data: ")), events[-3:]
            answer = plain.result(30)
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "server_error"
        assert server.proc.wait(15) == 0
    finally:
        server.stop(signal.SIGKILL)
    assert server.segments() == []


def test_scheduler_crash_stops_the_server_fast_and_a_start_sweeps_dead_launches(demo_model_dir: Path) -> None:
    # What a launch whose every process died (say, a whole cgroup OOM-killed) left behind.
    dead = new_launch_id(owner_pid=_dead_pid())
    ShmSegment.create_from_tensor(segment_name(dead, "leftover-1"), torch.ones(8))[0].close()
    ipc_address(dead, "sched")
    server = LiveServer(demo_model_dir, *ARGS)
    try:
        assert list_segments(dead) == [] and not os.path.exists(launch_dir(dead))
        [scheduler] = server.child_pids("scheduler")
        with httpx.stream("POST", server.base + "/v1/chat/completions", timeout=30, json={
            "model": "demo", "messages": [{"role": "user", "content": "go on"}], "stream": True,
            "max_tokens": 1900, "ignore_eos": True,
        }) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(scheduler, signal.SIGKILL)
            killed = time.monotonic()
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2].removeprefix("data: "))
        code = server.proc.wait(10)
        assert time.monotonic() - killed < 3.0 and code != 0
        out = server.output()
        assert "scheduler[0]" in out and "killed by SIGKILL" in out, out
    finally:
        server.stop(signal.SIGKILL)
    assert server.segments() == []


def test_idle_segments_expire_and_a_killed_launcher_leaves_no_shared_memory(demo_model_dir: Path) -> None:
    server = LiveServer(demo_model_dir, *ARGS, "--shm-retain-idle-s", "1")
    try:
        # A finished request's image stays for the next turn, but not for ever.
        assert post(server, 6).status_code == 200
        assert server.segments() and server.stats()["shm"]["retained_segments"] == 1
        wait_until(lambda: not server.segments(), 5, "the idle segment to expire")
        assert server.stats()["shm"]["retained_segments"] == 0
        assert post(server, 7).status_code == 200
        assert server.segments()
        children = [pid for role in ("model", "scheduler", "tokenizer") for pid in server.child_pids(role)]
        assert len(children) == 4
        os.kill(server.proc.pid, signal.SIGKILL)
        wait_until(lambda: all(gone(pid) for pid in children), 15, "the children to exit")
        assert server.segments() == []
        assert not os.path.exists(launch_dir(server.launch_id))
    finally:
        server.stop(signal.SIGKILL)
