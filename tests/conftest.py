"""Fixtures shared by every test: the demo checkpoint and deterministic test images."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from workers.engine.models.demo_writer import ensure_demo_model

ImageFactory = Callable[..., Image.Image]


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """An RGB image of uniform random pixels; the same (width, height, seed) always gives the same pixels."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint, written once per test session into a temp dir (never the user's cache)."""
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "demo-model")


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3-VL (dense) demo checkpoint, written once per test session."""
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "qwen3-vl", family="qwen3_vl")


@pytest.fixture(scope="session")
def qwen3_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3-VL-MoE demo checkpoint, written once per test session."""
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "qwen3-vl-moe", family="qwen3_vl_moe")


@pytest.fixture(scope="session")
def qwen3_5_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3.5 (dense, hybrid Gated DeltaNet) demo checkpoint, written once per test session."""
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "qwen3.5", family="qwen3_5")


@pytest.fixture(scope="session")
def qwen3_5_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3.5-MoE demo checkpoint, written once per test session."""
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "qwen3.5-moe", family="qwen3_5_moe")


@pytest.fixture(scope="session")
def gemma4_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Gemma 4 (dense) demo checkpoint, written once per test session."""
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "gemma4", family="gemma4")


@pytest.fixture(scope="session")
def gemma4_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Gemma 4 MoE demo checkpoint, written once per test session."""
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "gemma4-moe", family="gemma4_moe")


@pytest.fixture
def make_image() -> ImageFactory:
    """`make_image(width, height, seed=0)` -> a deterministic noise image (see `noise_image`)."""
    return noise_image
