"""Qwen3-VL dense and MoE served end to end (`glimpse serve --tp 2` over gloo, real processes, the official
openai client): multi-image answers equal transformers' generate, a resent image is not encoded again, and a
checkpoint of an unsupported architecture stops start-up with one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reference import greedy_text
from tests.server.live import LiveServer, data_url, image_message, png_bytes

MAX_NEW = 12
ODD = [(57, 83), (300, 200), (123, 77), (640, 480), (29, 29)]
FIVE = [png_bytes(w, h, seed=70 + i) for i, (w, h) in enumerate(ODD)]


def ask(server: LiveServer, images: list[bytes], text: str) -> str:
    resp = server.client(timeout=120).chat.completions.create(
        model="demo", messages=image_message(text, [data_url(b) for b in images]),  # type: ignore[arg-type]
        max_tokens=MAX_NEW, temperature=0,
    )
    return resp.choices[0].message.content or ""


@pytest.fixture(scope="module", params=["dense", "moe"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[LiveServer, Path]]:
    moe = request.param == "moe"
    model_dir: Path = request.getfixturevalue("qwen3_moe_model_dir" if moe else "qwen3_model_dir")
    server = LiveServer(model_dir, "--tp", "2", "--tokenizer-workers", "1", "--chunk-size", "64")
    yield server, model_dir
    assert server.stop() == 0, server.output()
    assert server.segments() == []


def test_five_images_over_tp2_equal_transformers(served: tuple[LiveServer, Path]) -> None:
    server, model_dir = served
    text = "Compare these five pages."
    assert ask(server, FIVE, text) == greedy_text(model_dir, FIVE, text, MAX_NEW)


def test_resent_images_are_not_encoded_again(served: tuple[LiveServer, Path]) -> None:
    server, model_dir = served
    images = FIVE[:2]
    ask(server, images, "First look.")
    before = server.stats()["images_encoded"]
    text = "Second look."
    assert ask(server, images, text) == greedy_text(model_dir, images, text, MAX_NEW)
    deadline = time.monotonic() + 5
    while server.stats()["images_encoded"] != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stats()["images_encoded"] == before


def test_unsupported_architecture_fails_start_up_in_one_line(qwen3_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "llava"
    model.mkdir()
    config = json.loads((qwen3_model_dir / "config.json").read_text())
    config["architectures"] = ["LlavaForConditionalGeneration"]
    (model / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "LlavaForConditionalGeneration" in lines[0] and "Qwen3VLMoeForConditionalGeneration" in lines[0]
    assert "Traceback" not in proc.stderr
