"""Fixtures shared by the worker tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ipc.launch import cleanup_launch_dir, new_launch_id
from ipc.shm import list_segments, sweep


@pytest.fixture
def launch_id() -> Iterator[str]:
    lid = new_launch_id()
    yield lid
    leftovers = list_segments(lid)
    sweep(lid)
    cleanup_launch_dir(lid)
    assert leftovers == [], f"test leaked shm segments: {leftovers}"
