"""Fixtures of the frontend tests: `serve(**config_overrides)` starts a server, `srv` is a default one;
`hostile` is one real `glimpse serve` with tight limits shared by the hostile-client modules
(test_media_fetch.py, test_http_limits.py), `media` and `other_media` its loopback image servers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipc.launch import new_launch_id
from server.config import ServerConfig
from server.http_guard import HttpLimits
from tests.media_server import MediaServer
from tests.reference import HFReference
from tests.server.harness import API_KEY, Served, ServeFactory, check_clean
from tests.server.live import LiveServer, png_bytes, serving
from workers.engine.config import EngineConfig


@pytest.fixture
def serve() -> Iterator[ServeFactory]:
    started: list[Served] = []

    def factory(
        ready: bool = True, loop: str = "uvloop", http_limits: HttpLimits | None = None, **overrides: Any
    ) -> Served:
        fields: dict[str, Any] = {"api_key": API_KEY, "tokenizer_workers": 1, "max_body_bytes": 1 << 20}
        fields.update(overrides)
        config = ServerConfig(EngineConfig(model="unused"), new_launch_id(), "demo", **fields)
        served = Served(config, ready, loop, http_limits)
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


@pytest.fixture(scope="session")
def live(demo_server: LiveServer) -> LiveServer:
    """The shared demo server, by the name the endpoint modules use (a module with a server of its own overrides it)."""
    return demo_server


@pytest.fixture(scope="module")
def ref(demo_model_dir: Path) -> HFReference:
    """transformers' model of the demo checkpoint (a module about another checkpoint overrides it)."""
    return HFReference(demo_model_dir)


# The hostile-client server's limits (tests read them to bound their timings).
MEDIA_TIMEOUT_S = 3.0
HEADER_TIMEOUT_S, IDLE_TIMEOUT_S, KEEP_ALIVE_S = 2.0, 2.0, 1.0
MAX_CONNECTIONS = 1000


# The shared demo server's CORS origins (test_endpoints_api.py checks them; no other module sends an Origin).
ORIGIN = "https://app.example.com"
ORIGINS = f"{ORIGIN},http://localhost:3000"


@pytest.fixture(scope="session")
def demo_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    """The demo server with nothing set but one tokenizer worker and CORS origins, shared by the modules that need no
    flag of their own (render, sampling, cache identity, image detail, tokenize, structured outputs, the OpenAI and
    SGLang endpoints; the encoder tests' server without encoders): one start-up instead of nine, ~20 s each on a
    2-core CI box. Their tests count from a settled baseline (``settled_stats``), never from zero."""
    yield from serving(demo_model_dir, "--allowed-origins", ORIGINS)


@pytest.fixture(scope="session")
def qwen3_server(qwen3_model_dir: Path) -> Iterator[LiveServer]:
    """The Qwen3-VL demo server with nothing set but one tokenizer worker, shared like ``demo_server`` (the tool-call
    tests, and the encoder tests' server without encoders)."""
    yield from serving(qwen3_model_dir)


@pytest.fixture(scope="session")
def media() -> Iterator[MediaServer]:
    """The hostile server's one exempt private address:port (an operator's internal image store)."""
    server = MediaServer(png_bytes(64, 48, seed=5))
    yield server
    server.close()


@pytest.fixture(scope="session")
def other_media() -> Iterator[MediaServer]:
    """Loopback, but not exempt: nothing may reach it."""
    server = MediaServer(png_bytes(64, 48, seed=6))
    yield server
    server.close()


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="session")
def hostile(demo_model_dir: Path, media: MediaServer, media_dir: Path) -> Iterator[LiveServer]:
    """One tokenizer (head-of-line blocking would show), short media and HTTP timeouts."""
    server = LiveServer(
        demo_model_dir, "--tokenizer-workers", "1", "--max-model-len", "2048",
        "--media-timeout", str(MEDIA_TIMEOUT_S), "--allow-private-media-addresses", f"127.0.0.1:{media.port}",
        "--allowed-local-media-path", str(media_dir), "--http-max-connections", str(MAX_CONNECTIONS),
        "--http-header-timeout", str(HEADER_TIMEOUT_S), "--http-idle-timeout", str(IDLE_TIMEOUT_S),
        "--http-keep-alive-timeout", str(KEEP_ALIVE_S),
    )
    yield server
    log = server.output()
    assert server.stop() == 0
    assert "Traceback" not in log and " 500 " not in log, log
    assert server.segments() == []
