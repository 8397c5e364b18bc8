"""A restarted server reuses what its GPU workers compiled: the launcher hands its children an Inductor cache under
~/.cache/glimpse (Inductor's own default under /tmp is emptied by the systemd unit's PrivateTmp at every restart) and
Triton's autotuning cache, and an operator's own setting wins. Read from the real model worker's environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.live import LiveServer, proc_environ


def test_the_model_worker_gets_the_compile_caches_under_home(
    demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This process may hold Inductor's /tmp default already (importing torch._dynamo writes it into os.environ).
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    server = LiveServer(demo_model_dir, "--tokenizer-workers", "1",
                        env={"HOME": str(tmp_path), "TRITON_CACHE_AUTOTUNING": "0"})  # fmt: skip
    try:
        [model] = server.child_pids("model")
        env = proc_environ(model)
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / ".cache" / "glimpse" / "inductor")
        assert env["TRITON_CACHE_AUTOTUNING"] == "0"  # the operator's value, not the default "1"
    finally:
        server.finish()
