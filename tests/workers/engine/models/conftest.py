"""Fixtures of the model tests that several modules use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.workers.engine.models.qwen3_tiny import save_checkpoints


@pytest.fixture(scope="session")
def qwen3_tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """kind ("dense", "moe") -> (a tiny random Qwen3-VL checkpoint saved by transformers, the model itself)."""
    return save_checkpoints(tmp_path_factory)


@pytest.fixture(scope="session")
def fp8_demo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """(demo family, "fp8-block" | "fp8-dynamic") -> that FP8 demo checkpoint, written once per session."""
    from workers.engine.models.demo_writer import write_demo_model

    root = tmp_path_factory.mktemp("fp8")
    written: dict[tuple[str, str], Path] = {}

    def get(family: str, fmt: str) -> Path:
        if (family, fmt) not in written:
            written[family, fmt] = write_demo_model(root / f"{family}-{fmt}", family, fmt)
        return written[family, fmt]

    return get
