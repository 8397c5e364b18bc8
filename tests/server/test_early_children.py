"""Model workers started before the launcher has its config (server/children.py's EarlyChildren): a start refused
while they import ends them at once and leaves no process behind; children never given a config are killed, not
waited for. (Every live-server test serves through them: tests/server/live.py starts `glimpse serve`.) The command
line itself imports no torch before a subcommand needs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from server.children import EarlyChildren
from tests.server.test_crashes import gone, wait_until


def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries ``GLIMPSE_TEST_TAG=tag`` (inherited from the launcher)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"GLIMPSE_TEST_TAG={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return [pid for pid in found if not gone(pid)]


def test_a_refused_flag_ends_the_early_workers_at_once(demo_model_dir: Path) -> None:
    tag = uuid.uuid4().hex
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(demo_model_dir), "--port", "0", "--tp", "2",
         "--encoder-workers", "1", "--block-size", "0", "--log-level", "debug"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "GLIMPSE_TEST_TAG": tag},
    )  # fmt: skip
    took = time.monotonic() - began
    assert done.returncode == 1, done.stderr[-2000:]
    assert "glimpse serve: --block-size must be 1 or more" in done.stderr, done.stderr[-2000:]
    # both ranks and the encoder had been started before the flag was read; the refusal did not wait for their imports
    for child in ("model[0]", "model[1]", "encoder[0]"):
        assert f"started {child} pid" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert took < 30, took
    wait_until(lambda: not tagged(tag), 5, "the early model workers to be gone")


def test_children_never_given_a_config_are_killed_not_awaited() -> None:
    early = EarlyChildren([("model", 0), ("model", 1)])
    children = early.waiting
    assert [c.name for c in children] == ["model[0]", "model[1]"] and all(c.process.is_alive() for c in children)
    began = time.monotonic()
    early.close()  # they are still importing torch: waiting for them would take seconds
    assert time.monotonic() - began < 3.0
    assert [c.process.exitcode for c in children] == [-signal.SIGKILL] * 2
    assert early.waiting == [] and early.take(None, "model", 0) is None  # type: ignore[arg-type]


def test_the_command_line_imports_no_torch_before_a_subcommand_runs() -> None:
    probe = ("import sys, server.cli; server.cli.build_parser(); "
             "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
