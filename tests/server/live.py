"""A real `glimpse serve` in a subprocess, for end-to-end tests with the official openai client."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import openai

from ipc.launch import new_launch_id
from ipc.shm import list_segments

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def png_bytes(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def image_message(text: str, urls: list[str]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def serving(model_dir: Path, *extra: str) -> Iterator[LiveServer]:
    """A module fixture's body: the demo server with one tokenizer worker, stopped cleanly afterwards."""
    server = LiveServer(model_dir, "--tokenizer-workers", "1", *extra)
    yield server
    assert server.stop() == 0, server.output()


class LiveServer:
    def __init__(
        self, model_dir: Path, *extra: str, env: dict[str, str] | None = None, ready_timeout: float = 120.0
    ) -> None:
        self.port = free_port()
        self.launch_id = new_launch_id()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir), "--served-model-name", "demo",
            "--port", str(self.port), "--launch-id", self.launch_id,
            *([] if "--kv-cache-mb" in extra else ["--num-kv-blocks", "512"]),  # a count would override the budget
            "--log-level", "warning", *extra,
        ]
        # Unlinked at once: output() reads it while the test runs, and nothing is left behind in /tmp after it.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.crashed = False  # a test killed one of its processes: the server stops on its own (``finish``)
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.wait_healthy(ready_timeout)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def client(self, **kw: Any) -> openai.OpenAI:
        import openai  # here, not at the top: benchmarks reuse this class on machines without the SDK

        return openai.OpenAI(base_url=self.base + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = httpx.get(self.base + "/admin/stats", timeout=5.0).json()
        return result

    def stats_when(self, key: str, value: int, timeout: float = 5.0) -> dict[str, Any]:
        """/admin/stats once count ``key`` (top level, or in ``state_pool``) reached ``value``, or after ``timeout``
        (the scheduler's counters arrive every 0.25 s)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            pool = stats.get("state_pool") or {}
            if (pool[key] if key in pool else stats[key]) >= value or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def settled_stats(self) -> dict[str, Any]:
        """/admin/stats once the scheduler's counters stopped moving (they arrive every 0.25 s): a baseline that a
        request finished just before cannot still change."""
        last = self.stats()
        for _ in range(20):
            time.sleep(0.3)
            now = self.stats()
            if now["prompt_tokens_computed"] == last["prompt_tokens_computed"] and now["steps"] == last["steps"]:
                return now
            last = now
        return last

    def child_pids(self, role: str) -> list[int]:
        """PIDs of this server's children of one role, read from /proc (name set by the launcher)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        pids = []
        for pid in out:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                comm = Path(f"/proc/{pid}/comm").read_text()
            except OSError:
                continue
            # spawn_main: a launcher child (multiprocessing's resource tracker inherits the env too).
            if b"spawn_main" in cmdline and role in _proc_title(int(pid), comm):
                pids.append(int(pid))
        return pids

    def segments(self) -> list[str]:
        return list_segments(self.launch_id)

    def finish(self) -> None:
        """A module fixture's teardown: a clean stop (exit 0), or where a test crashed one of its processes the
        server's own exit; either way no shared-memory segment of the launch is left."""
        if self.crashed:
            self.proc.wait(30)
            self.log.close()
        else:
            assert self.stop() == 0, self.output()
        assert self.segments() == []

    def assert_crash_failed_fast(self, events: list[str], answer: Any, killed: float, role: str) -> None:
        """After a test SIGKILLed the process ``role`` (e.g. ``encoder[0]``) at ``killed`` (monotonic): the
        in-flight stream ended in an error event, the waiting request got a 503 naming it, and the server exited
        non-zero within 3 s saying which process died."""
        assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2].removeprefix("data: "))
        assert answer.status_code == 503 and role in answer.json()["error"]["message"]
        code = self.proc.wait(10)
        assert time.monotonic() - killed < 3.0 and code != 0
        out = self.output()
        assert role in out and "killed by SIGKILL" in out, out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)
        finally:
            self.log.close()


def proc_environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with (what its parent handed it)."""
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def _proc_title(pid: int, comm: str) -> str:
    return proc_environ(pid).get("GLIMPSE_ROLE", comm)
