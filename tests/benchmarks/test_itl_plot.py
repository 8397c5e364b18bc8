"""benchmarks/tools/itl_plot.py: the gaps it takes from a result file, its percentile table and its figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.tools import itl_plot

FIXTURE = Path(__file__).parent / "fixtures" / "serving-itl.json"


def test_gaps_are_every_token_gap_of_the_successful_requests() -> None:
    result = json.loads(FIXTURE.read_text())
    assert sorted(itl_plot.gaps(result)) == [9.0, 10.0, 10.5, 11.0, 12.0, 150.0, 180.0]  # the failed one's 999 left out


def test_table_and_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    even = tmp_path / "even.json"
    even.write_text(json.dumps({"requests": [{"ok": True, "itl_ms": [float(g) for g in range(1, 101)]}]}))
    out = tmp_path / "itl.png"
    monkeypatch.setattr(sys, "argv", ["itl_plot", str(out), f"even={even}", f"fixture={FIXTURE}",
                                      "--marks", "vLLM=50:8.5,99:117.6,100:368"])
    itl_plot.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "gaps", "p50", "p90", "p99", "p99.9", "max", ">", "100", "ms"]
    # numpy's linear percentiles of 1..100: p50 50.5, p90 90.1, p99 99.01 (shown 99.0), p99.9 99.901 (99.9)
    assert lines[2].split() == ["even", "100", "50.5", "90.1", "99.0", "99.9", "100.0", "0"]
    assert lines[3].split()[0] == "fixture" and lines[3].split()[1] == "7" and lines[3].split()[-1] == "2"
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_marks_need_a_label_and_points() -> None:
    assert itl_plot.parse_marks("vLLM 0.24=50:8.5,100:368") == ("vLLM 0.24", {50.0: 8.5, 100.0: 368.0})
    with pytest.raises(SystemExit, match="--marks takes"):
        itl_plot.parse_marks("50:8.5")
