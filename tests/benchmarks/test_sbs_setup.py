"""benchmarks/tools/sbs_setup.py: the side-by-side harness copied with glimpse's environment hooks, checked by
running the patched module's top level under the variables docs/benchmarks.md's commands set."""

from __future__ import annotations

import runpy
import stat
from pathlib import Path

import pytest

from benchmarks.tools.sbs_setup import add_hooks, main

# The harness's top level as ../shared/vllm-sbs/sbs.py writes it: multi-line lists, os imported.
SBS = '''import os
import sys

BENCHES: list[tuple[str, str, list[str]]] = [
    ("warmup", "serving", ["--num-prompts", "1"]),
    ("a", "serving", ["--num-prompts", "1", "--images-per-request", "8"]),
    ("b", "serving", ["--num-prompts", "64",
                      "--concurrency", "64"]),
    ("c", "multiturn", ["--rounds", "8"]),
    ("d", "serving", ["--num-prompts", "3"]),
]
GLIMPSE_FLAGS = ["--max-model-len", "32768",
                 "--num-kv-blocks", "12288"]
VLLM_FLAGS = ["--served-model-name", "demo", "--max-model-len", "32768",
              "--limit-mm-per-prompt", '{"image": 8}']
VLLM_ENV = {"VLLM_NO_USAGE_STATS": "1"}


def main() -> int:
    return 0
'''


def harness(tmp_path: Path) -> Path:
    src = tmp_path / "shared" / "vllm-sbs"
    src.mkdir(parents=True)
    (src / "sbs.py").write_text(SBS)
    (src / "run.sh").write_text("#!/bin/bash\n")
    for path in (src / "sbs.py", src / "run.sh", src):  # ../shared is read-only
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    return src


def top_level(path: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, object]:
    for key in ("SBS_BENCHES", "SBS_GLIMPSE_EXTRA", "SBS_VLLM_EXTRA", "SBS_LOGPROBS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return runpy.run_path(str(path))


def test_the_copy_honours_the_documented_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = harness(tmp_path)
    dest = tmp_path / "checkout" / "tools" / "vllm-sbs"
    assert main([str(src), str(dest)]) == 0
    sbs = dest / "sbs.py"
    assert sbs.stat().st_mode & stat.S_IWUSR  # writable, unlike its source
    plain = top_level(sbs, monkeypatch, SBS_LOGPROBS="0")
    assert plain["BENCHES"] == runpy.run_path(str(src / "sbs.py"))["BENCHES"]  # nothing set: the harness as it was
    env = top_level(sbs, monkeypatch, SBS_BENCHES="warmup,b", SBS_GLIMPSE_EXTRA="--chunk-size 8192",
                    SBS_VLLM_EXTRA="--limit-mm-per-prompt '{\"image\": 64}'")
    assert [(n, f[-1]) for n, _, f in env["BENCHES"]] == [("warmup", "1"), ("b", "--logprobs")]  # type: ignore[attr-defined]
    assert env["GLIMPSE_FLAGS"] == ["--max-model-len", "32768", "--num-kv-blocks", "12288", "--chunk-size", "8192"]
    assert env["VLLM_FLAGS"][-2:] == ["--limit-mm-per-prompt", '{"image": 64}']  # type: ignore[index]
    with pytest.raises(SystemExit, match="unknown benches"):
        top_level(sbs, monkeypatch, SBS_BENCHES="b,e")
    assert main([str(src), str(dest)]) == 0  # again over the old copy
    assert sbs.read_text().count("sbs_setup.py ---") == 1
    assert add_hooks(sbs.read_text()) == sbs.read_text()


def test_a_harness_it_was_not_written_for_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "other"
    src.mkdir()
    (src / "sbs.py").write_text("import os\nBENCHES = []\nGLIMPSE_FLAGS = []\n")
    (src / "run.sh").write_text("")
    assert main([str(src), str(tmp_path / "dest")]) == 1
    assert "no VLLM_FLAGS" in capsys.readouterr().err
    assert main([str(tmp_path / "missing"), str(tmp_path / "dest2")]) == 1
