"""An encoder worker's start-up warm-up (workers/encoder/warmup.py): its tower gets the fused kernels a model worker's
tower has (unless ``fused_kernels`` is off, or compiling them fails: then eager again) and runs the warm-up's ViT
calls once each. The logic runs here on the CPU, where the fused sites stay eager (fused.worth_it is CUDA-only) and
the CUDA synchronize is stood in for; on a GPU, an encoder tower built for CUDA serves with its fused kernels and
gives the eager tower's rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.conftest import noise_image
from workers.encoder import warmup
from workers.encoder.tower import EncoderTower
from workers.engine.config import EngineConfig
from workers.engine.kernels import fused
from workers.engine.models import load_spec
from workers.engine.prompt.processor import MMProcessor

CALLS = [[(1, 4, 4)], [(1, 4, 8), (1, 4, 8)], [(1, 8, 4)], [(1, 4, 4)]]  # 16, 64, 32, 16 patches: 16 runs once


def flags(module: nn.Module) -> set[bool]:
    return {m.fused for m in module.modules() if isinstance(getattr(m, "fused", None), bool)}


@pytest.fixture
def tower(demo_model_dir: Path, launch_id: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, list[int]]]:
    """The demo's tower on the CPU, its calls recorded (patches per call), the warm-up's CUDA-only steps stood in for."""
    engine = EngineConfig(model=str(demo_model_dir), spec=load_spec(demo_model_dir))
    built = EncoderTower(engine, launch_id, 0, torch.device("cpu"))
    assert not built.fused and flags(built.tower) == {False}  # the CPU build warms nothing
    seen: list[int] = []
    forward = built.tower.forward

    def recording(pixels: Tensor, grids: Any) -> Tensor:
        seen.append(pixels.shape[0])
        out: Tensor = forward(pixels, grids)
        return out

    monkeypatch.setattr(built.tower, "forward", recording)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(warmup, "warm_tower_attention", lambda *a: seen.append(-1))
    monkeypatch.setattr(warmup, "vit_calls", lambda *a: CALLS)
    yield built, seen


def test_the_tower_gets_fused_kernels_and_runs_each_warm_call_once(tower: tuple[Any, list[int]]) -> None:
    built, seen = tower
    spec, cfg = built.engine.model_spec(), built.engine
    assert warmup.warm_encoder_tower(built.tower, spec, cfg, built.dtype, torch.device("cpu"))
    assert flags(built.tower) == {True}
    m = spec.spatial_merge_size
    compile_calls = [4 * m * m, 8 * m * m, m * m]  # warmup.fused_grids
    assert seen == [-1, *compile_calls, 64, 32, 16]  # attention first, then largest call first, each count once


def test_without_fused_kernels_the_tower_stays_eager(tower: tuple[Any, list[int]]) -> None:
    built, seen = tower
    cfg = EngineConfig(**{**built.engine.__dict__, "fused_kernels": False})
    assert not warmup.warm_encoder_tower(built.tower, built.engine.model_spec(), cfg, built.dtype, torch.device("cpu"))
    assert flags(built.tower) == {False} and seen == [-1, 64, 32, 16]


def test_a_failed_compile_leaves_the_tower_eager_and_still_warms_it(
    tower: tuple[Any, list[int]], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    built, seen = tower

    class Broken:
        def __enter__(self) -> None:
            raise RuntimeError("no C compiler")

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(fused, "forced", Broken)
    assert not warmup.warm_encoder_tower(built.tower, built.engine.model_spec(), built.engine, built.dtype,
                                         torch.device("cpu"))
    assert flags(built.tower) == {False} and seen == [-1, 64, 32, 16]
    assert "fused kernels are unavailable" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_encoder_serves_with_fused_kernels_and_the_eager_rows(demo_model_dir: Path, launch_id: str) -> None:
    device = torch.device("cuda", 0)
    engine = EngineConfig(model=str(demo_model_dir), spec=load_spec(demo_model_dir), device="cuda", dtype="float32")
    built = EncoderTower(engine, launch_id, 0, device)
    assert built.fused and flags(built.tower) == {True}
    image = MMProcessor(demo_model_dir).process_image(noise_image(120, 90, seed=6))
    pixels = image.pixel_values.to(device, torch.float32)
    with torch.inference_mode():
        got = built.tower(pixels, [image.grid])
        fused.enable(built.tower, False)
        want = built.tower(pixels, [image.grid])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
