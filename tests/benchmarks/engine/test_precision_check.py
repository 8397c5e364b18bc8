"""benchmarks.engine.precision_check end to end on the demo shape (CPU): it drives the real Engine through the step
bench's spy on the sampler, so a change to the sampler's signature breaks it here rather than on a GPU lease."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_precision_check_runs_and_reports_every_path() -> None:
    cmd = [sys.executable, "-m", "benchmarks.engine.precision_check", "--shape", "demo", "--device", "cpu", "--batch", "2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if "rel L2" in line]
    assert len(rows) == 6, out.stdout
    # every path against float32 on the CPU: the same argmax for each row
    for row in rows:
        equal = row.split("argmax equal")[1].split()[0]
        got, total = equal.split("/")
        assert got == total and int(total) > 0, row
