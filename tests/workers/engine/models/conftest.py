"""Fixtures of the model tests that several modules use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.workers.engine.models.qwen3_tiny import save_checkpoints


@pytest.fixture(scope="session")
def qwen3_tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """kind ("dense", "moe") -> (a tiny random Qwen3-VL checkpoint saved by transformers, the model itself)."""
    return save_checkpoints(tmp_path_factory)
