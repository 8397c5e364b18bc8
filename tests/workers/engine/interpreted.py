"""Run a check under Triton's interpreter, in a fresh Python: TRITON_INTERPRET must be set before triton is imported,
so it cannot be switched on inside the test process. The check prints "ok" last when every assertion held."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run_interpreted(*args: str, timeout: float = 600) -> None:
    """``python ARGS`` (e.g. "-c", CODE or "-m", MODULE) from the repository root, under the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok"), done.stdout
