"""Every family served with the config fields where its other published sizes differ from the demo
(published_variants.py: tied heads, linear-attention and GQA ratios, layer patterns, per-layer inputs, KV sharing,
an audio tower, the original flat Qwen2.5-VL config): the checkpoint parses to that shape, and the offline Engine's
greedy tokens equal transformers' generate on it (CPU, float32) for text and for one image in chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from tests.conftest import noise_image
from tests.workers.engine.models.engine_harness import GREEDY, Reference, chat, make_engine
from tests.workers.engine.models.published_variants import VARIANTS, write_variant
from workers.engine.models import load_spec


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Reference]:
    name: str = request.param
    model_dir = write_variant(VARIANTS[name], tmp_path_factory.mktemp("variant") / name)
    return name, model_dir, Reference(model_dir)


def test_the_checkpoint_has_the_variants_shape(checkpoint: tuple[str, Path, Reference]) -> None:
    name, model_dir, _ = checkpoint
    variant = VARIANTS[name]
    text = load_spec(model_dir).text
    assert {key: getattr(text, key) for key in variant.expect} == dict(variant.expect)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # A tied head is not stored (as transformers saves it and the Hub has it); an untied one is.
    assert ("lm_head.weight" in names) != text.tie_word_embeddings
    assert any(n.startswith("model.audio_tower.") for n in names) == ("audio_config" in variant.root)
    if variant.flat:
        assert "model.embed_tokens.weight" in names and any(n.startswith("visual.") for n in names)


def test_text_only(checkpoint: tuple[str, Path, Reference]) -> None:
    _, model_dir, reference = checkpoint
    messages = [{"role": "user", "content": "Describe the chart on page three."}]
    [out] = make_engine(model_dir).generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)


def test_one_image_in_chunks(checkpoint: tuple[str, Path, Reference]) -> None:
    _, model_dir, reference = checkpoint
    messages = chat("What is in this picture?", [noise_image(300, 200, seed=42)])
    [out] = make_engine(model_dir, chunk_size=32).generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)
