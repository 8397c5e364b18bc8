"""Fixtures of the frontend tests: `serve(**config_overrides)` starts a server, `srv` is a default one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ipc.launch import new_launch_id
from server.config import ServerConfig
from tests.server.harness import API_KEY, Served, ServeFactory, check_clean
from workers.engine.config import EngineConfig


@pytest.fixture
def serve() -> Iterator[ServeFactory]:
    started: list[Served] = []

    def factory(ready: bool = True, loop: str = "uvloop", **overrides: Any) -> Served:
        fields: dict[str, Any] = {"api_key": API_KEY, "tokenizer_workers": 1, "max_body_bytes": 1 << 20}
        fields.update(overrides)
        config = ServerConfig(EngineConfig(model="unused"), new_launch_id(), "demo", **fields)
        served = Served(config, ready, loop)
        started.append(served)
        return served

    yield factory
    for served in started:
        try:
            check_clean(served)
        finally:
            served.stop()


@pytest.fixture
def srv(serve: ServeFactory) -> Served:
    return serve()
