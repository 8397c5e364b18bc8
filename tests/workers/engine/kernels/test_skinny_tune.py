"""The start-up choice of the skinny GEMM's tile per weight shape (skinny_tune.py): the fastest candidate wins, the
choice is registered with skinny_gemm and kept on disk, and a restart reads it back instead of measuring. The
timer is injected on the CPU; the real CUDA-graph timer runs where there is a GPU (marked ``gpu``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workers.engine.kernels import skinny_gemm, skinny_tune
from workers.engine.kernels.skinny_gemm import Tile

KEY = "test card|132 SMs|torch.bfloat16"


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # small weights stand for large ones: thresholds in bytes of these CPU tensors
    monkeypatch.setattr(skinny_tune, "MIN_BYTES", 1 << 10)
    monkeypatch.setattr(skinny_tune, "MIN_PASS_BYTES", 16 << 10)
    saved = dict(skinny_gemm._measured)
    skinny_gemm._measured.clear()
    yield
    skinny_gemm._measured.clear()
    skinny_gemm._measured.update(saved)


def weights() -> list[torch.Tensor]:
    wide = [torch.zeros(512, 256) for _ in range(2)]  # 512 KiB each: measured
    narrow = torch.zeros(256, 1024)  # one weight of 1 MiB: measured
    lone = torch.zeros(32, 64)  # 8 KiB alone: under MIN_PASS_BYTES, keeps the rule
    tiny = torch.zeros(2, 64)  # 512 bytes, under MIN_BYTES: not a candidate at all
    return [*wide, wide[0], narrow, lone, tiny]  # wide[0] twice: a tied weight is timed once


def test_fastest_candidate_is_chosen_kept_and_read_back(tmp_path: Path) -> None:
    calls: list[tuple[tuple[int, int], Tile | None, int, int]] = []
    fast = Tile(32, 128, 1, 2, 4)

    def timer(group: list[torch.Tensor], pick: Tile | None, rows: int) -> float:
        calls.append((tuple(group[0].shape), pick, rows, len(group)))  # type: ignore[arg-type]
        if group[0].shape == (256, 1024):
            return 1.0 if pick is None else 2.0  # cuBLAS wins the narrow shape
        return 0.5 if pick == fast else 1.0

    path = tmp_path / "tiles.json"
    chosen = skinny_tune.tune(weights(), KEY, 132, timer, path)
    assert chosen == {(512, 256): fast, (256, 1024): None}
    assert skinny_gemm.measured(512, 256) == (True, fast)
    assert skinny_gemm.measured(256, 1024) == (True, None)
    assert skinny_gemm.measured(32, 64) == (False, None)
    # every candidate at both row counts, over the shape's distinct weights
    wide_calls = [c for c in calls if c[0] == (512, 256)]
    assert {c[2] for c in wide_calls} == set(skinny_tune.ROWS) and all(c[3] == 2 for c in wide_calls)
    assert len(wide_calls) == len(skinny_tune.candidates(512, 256, 132)) * len(skinny_tune.ROWS)
    assert json.loads(path.read_text())[KEY] == {"512x256": list(fast), "256x1024": None}

    # A restart: the same choices from the file, nothing timed.
    skinny_gemm._measured.clear()

    def no_timer(group: list[torch.Tensor], pick: Tile | None, rows: int) -> float:
        raise AssertionError("measured again")

    assert skinny_tune.tune(weights(), KEY, 132, no_timer, path) == chosen
    assert skinny_gemm.measured(512, 256) == (True, fast)

    # Another card (key) measures its own and keeps the first card's entry.
    skinny_tune.tune(weights(), "other card", 132, timer, path)
    assert set(json.loads(path.read_text())) == {KEY, "other card"}


def test_the_timed_candidates_are_launched_once_together_before_any_timing(tmp_path: Path) -> None:
    """compile_first gets every Triton candidate of every shape to be timed, at both row counts, in one call before
    the first timing (so their compiles overlap on threads); a restart that reads the file launches nothing."""
    events: list[str] = []
    launched: list[tuple[tuple[int, int], Tile, int]] = []

    def compile_first(runs: list[tuple[torch.Tensor, Tile, int]]) -> None:
        events.append("compile")
        launched.extend(((w.shape[0], w.shape[1]), tile, rows) for w, tile, rows in runs)

    def timer(group: list[torch.Tensor], pick: Tile | None, rows: int) -> float:
        events.append("time")
        return 1.0 if pick is None else 2.0

    path = tmp_path / "tiles.json"
    skinny_tune.tune(weights(), KEY, 132, timer, path, compile_first)
    assert events[0] == "compile" and events.count("compile") == 1 and events.count("time") > 0
    want = {(shape, c, rows) for shape in ((512, 256), (256, 1024)) for c in skinny_tune.candidates(*shape, 132)
            if c is not None for rows in skinny_tune.ROWS}
    assert set(launched) == want and len(launched) == len(want)  # the lone and tiny weights: none
    launched.clear()
    skinny_tune.tune(weights(), KEY, 132, timer, path, compile_first)
    assert launched == []
    skinny_tune.first_launches([])  # nothing to launch, no CUDA needed
    skinny_tune.first_launches([(torch.zeros(4, 4), Tile(32, 128, 1, 2, 4), 1)])  # CPU weights: the timer's business


def test_unreadable_or_unwritable_cache_only_costs_a_measure(tmp_path: Path) -> None:
    def timer(group: list[torch.Tensor], pick: Tile | None, rows: int) -> float:
        return 0.0 if pick is None else 1.0

    bad = tmp_path / "tiles.json"
    bad.write_text("{not json")
    assert skinny_tune.tune(weights(), KEY, 132, timer, bad)[(512, 256)] is None
    assert json.loads(bad.read_text())[KEY]["512x256"] is None  # rewritten whole
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert skinny_tune.tune(weights(), KEY, 132, timer, blocked / "tiles.json")[(512, 256)] is None


def test_candidates() -> None:
    # cuBLAS, the rule's tile, whole-K strips, and splits only where K divides into 128-wide blocks of >= 256
    got = skinny_tune.candidates(5120, 17408, 132)
    assert got[0] is None and got[1] == skinny_gemm.tile(5120, 17408, 132) and len(set(got)) == len(got)
    assert {t.split_k for t in got if t is not None} == {1, 2, 4, 8}
    assert {t.split_k for t in skinny_tune.candidates(4096, 768, 132) if t is not None} == {1, 2}  # 768 = 6 x 128


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert skinny_tune.enabled()
    monkeypatch.setenv(skinny_tune.ENV, "0")
    assert not skinny_tune.enabled()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measured_on_cuda() -> None:
    # the CUDA-graph timer, and a measured choice deciding the dispatch (cuBLAS, then the kernel)
    dev = torch.device("cuda")
    ws = [torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16) / 32 for _ in range(4)]
    assert skinny_tune.graph_ms(ws, None, 1) > 0 and skinny_tune.graph_ms(ws, Tile(32, 128, 2, 4, 4), 16) > 0
    skinny_gemm.use_measured(4096, 1024, None)
    x = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)
    assert not skinny_gemm.wanted(x, ws[0])  # cuBLAS was chosen: F.linear serves
    skinny_gemm.use_measured(4096, 1024, Tile(32, 128, 2, 4, 4))
    assert skinny_gemm.wanted(x, ws[0])
    torch.testing.assert_close(skinny_gemm.linear(x, ws[0]).float(), F.linear(x, ws[0]).float(), rtol=2e-2, atol=2e-2)
