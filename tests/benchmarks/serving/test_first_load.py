"""benchmarks/serving/first_load.py end to end on the demo model: a real server, the real bench client, one row per load."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_one_fresh_server_gives_a_row_per_load(demo_model_dir: Path, tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "benchmarks.serving.first_load", "--model", str(demo_model_dir), "--servers", "1",
        "--prompts", "3", "--resolution", "64x48", "--empty-triton-cache", "--", "--tokenizer-workers", "1",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+1\s+[12]\s", line)]
    assert [row[1] for row in rows] == ["1", "2"], out
    for row in rows:
        ready_s, a_ms, req_s, tpot_ms, wait_ms, gc_ms, compiled = map(float, row[2:])
        assert ready_s > 0 and a_ms > 0 and req_s > 0 and tpot_ms > 0 and wait_ms >= 0 and gc_ms >= 0
        assert compiled == 0  # no Triton on the CPU: its fresh cache stays empty
