"""The demo checkpoint: deterministic, loadable by transformers, lively enough for greedy-equality tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from server.cli import main
from tests.workers.engine.models.demo_harness import DEMO_FILES, greedy
from workers.engine.models.demo_writer import CACHE_ENV_VAR, SPECIAL_TOKENS, ensure_demo_model

ImageFactory = Callable[..., Image.Image]  # the `make_image` fixture from tests/conftest.py
REPO_ROOT = Path(__file__).resolve().parents[4]


def test_second_write_is_byte_identical(demo_model_dir: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert main(["demo-model", str(again)]) == 0
    names = {p.name for p in demo_model_dir.iterdir()}
    assert names == DEMO_FILES
    assert {p.name for p in again.iterdir()} == names
    for name in sorted(names):
        assert (again / name).read_bytes() == (demo_model_dir / name).read_bytes(), name


def test_cli_without_a_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "demo-model" in capsys.readouterr().out


def test_config_agrees_with_tokenizer(demo_model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(demo_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    text, vision = config.text_config, config.vision_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert (text.hidden_size, text.num_hidden_layers, head_dim, text.num_key_value_heads) == (64, 3, 16, 2)
    assert sum(text.rope_parameters["mrope_section"]) * 2 == head_dim
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size) == (4, 32, text.hidden_size)
    assert list(vision.fullatt_block_indexes) == [1, 3]
    assert text.vocab_size % 64 == 0 and text.vocab_size >= len(tokenizer) > 2000
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(SPECIAL_TOKENS)
    assert config.image_token_id == ids["<|image_pad|>"]
    assert config.video_token_id == ids["<|video_pad|>"]
    assert config.vision_start_token_id == ids["<|vision_start|>"]
    assert config.vision_end_token_id == ids["<|vision_end|>"]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(demo_model_dir)
    assert model.generation_config.eos_token_id == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert not config.tie_word_embeddings
    assert model.dtype == torch.float32


def test_chat_template_follows_qwen2_vl(demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)

    def render(messages: list[dict[str, Any]], prompt: bool = True) -> str:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))

    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    assert render([{"role": "user", "content": "Hi"}]) == (
        system + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    parts = [
        {"type": "text", "text": "Compare "},
        {"type": "image"},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    assert render([{"role": "user", "content": parts}, {"role": "assistant", "content": "Same."}], False) == (
        system
        + f"<|im_start|>user\nCompare {image} and {image}<|im_end|>\n"
        + "<|im_start|>assistant\nSame.<|im_end|>\n"
    )


def test_image_token_budget(demo_model_dir: Path, make_image: ImageFactory) -> None:
    processor = AutoProcessor.from_pretrained(demo_model_dir)
    out = processor.image_processor(images=[make_image(2000, 1500), make_image(20, 20)], return_tensors="pt")
    tokens = (out["image_grid_thw"].prod(dim=-1) // 4).tolist()
    assert 200 < tokens[0] <= 256  # max_pixels = 256 merged 28x28 tiles
    assert tokens[1] == 4  # min_pixels = 56x56


def test_transformers_runs_two_odd_images(demo_model_dir: Path, make_image: ImageFactory) -> None:
    processor = AutoProcessor.from_pretrained(demo_model_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(demo_model_dir).eval()
    images = [make_image(123, 77, seed=1), make_image(300, 200, seed=2)]
    generated, inputs = greedy(processor, model, images, 16)
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 8], [1, 14, 22]]
    n_pad = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_pad == (6 * 8 + 14 * 22) // 4
    assert len(generated) == 16
    # Greedy-equality tests are only as strong as the output is varied: it must not repeat one token.
    assert len(set(generated)) >= 8, generated
    # ... and it must depend on the pixels, or a misplaced image embedding would go unnoticed.
    other, _ = greedy(processor, model, [make_image(123, 77, seed=3), images[1]], 16)
    assert other != generated


_RACER = "import sys; from workers.engine.models.demo_writer import ensure_demo_model; print(ensure_demo_model({!r}))"


def test_ensure_demo_model_survives_a_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "cache" / "demo-model"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    racers = [
        subprocess.Popen([sys.executable, "-c", _RACER.format(str(target))], env=env, stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    for racer in racers:
        stdout, _ = racer.communicate(timeout=300)
        assert racer.returncode == 0
        assert stdout.decode().strip() == str(target)
    assert {p.name for p in target.iterdir()} == DEMO_FILES
    assert [p.name for p in target.parent.iterdir()] == ["demo-model"]  # no staging dirs left behind

    # Present already: returned as is, not rewritten; the env var picks the location when none is given.
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setenv(CACHE_ENV_VAR, str(target))
    assert ensure_demo_model() == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    ("family", "architecture"),
    [("qwen3_vl", "Qwen3VLForConditionalGeneration"), ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration")],
)
def test_cli_writes_each_family(tmp_path: Path, family: str, architecture: str) -> None:
    from server.cli import main
    from workers.engine.models import load_spec

    assert main(["demo-model", str(tmp_path / family), "--family", family]) == 0
    spec = load_spec(tmp_path / family)
    assert spec.architecture == architecture and spec.family == "qwen3_vl"
    assert all(oct(p.stat().st_mode)[-3:] == "644" for p in (tmp_path / family).iterdir())
