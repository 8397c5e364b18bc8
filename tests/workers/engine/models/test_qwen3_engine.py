"""Qwen3-VL dense and MoE through the offline Engine: greedy tokens equal transformers' generate on the demo
checkpoints (CPU, float32), with DeepStack rows sliced by chunks, served from the embedding cache, and under
prefix-cache hits that end inside an image."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import noise_image
from tests.workers.engine.models.engine_harness import FIVE, GREEDY, Reference, chat, make_engine
from workers.engine.models import UnsupportedModel, load_spec


@pytest.fixture(scope="module", params=["dense", "moe"])
def family(request: pytest.FixtureRequest) -> tuple[Path, Reference]:
    moe = request.param == "moe"
    model_dir: Path = request.getfixturevalue("qwen3_moe_model_dir" if moe else "qwen3_model_dir")
    return model_dir, Reference(model_dir)


def test_spec_carries_deepstack_width(qwen3_model_dir: Path) -> None:
    spec = load_spec(qwen3_model_dir)
    assert spec.family == "qwen3_vl"
    levels = len(spec.vision.deepstack_visual_indexes)
    assert levels >= 1 and spec.embed_width == spec.hidden_size * (1 + levels)


def test_text_only(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    messages = [{"role": "user", "content": "Describe the chart on page three."}]
    [out] = make_engine(model_dir).generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)


def test_one_image(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    messages = chat("What is in this picture?", [noise_image(300, 200, seed=42)])
    [out] = make_engine(model_dir).generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_five_odd_images_chunks_split_deepstack_rows(family: tuple[Path, Reference], chunk_size: int) -> None:
    model_dir, reference = family
    messages = chat("Compare these five pages.", FIVE)
    engine = make_engine(model_dir, chunk_size=chunk_size)
    [out] = engine.generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)
    assert engine.stats()["images_encoded"] == 5


def test_repeated_image_from_cache_and_prefix_ending_inside_an_image(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    engine = make_engine(model_dir, chunk_size=64)
    first = chat("Read these.", FIVE[:3])
    assert engine.generate([first], GREEDY)[0].token_ids == reference.generate(first)
    assert engine.stats()["images_encoded"] == 3
    # Same images, other question: the prompt's shared prefix ends inside the third image's span (its
    # last tokens are in a partial block), and all three images come from the embedding cache.
    second = chat("Now count the colours.", FIVE[:3])
    [out] = engine.generate([second], GREEDY)
    assert out.token_ids == reference.generate(second)
    stats = engine.stats()
    assert stats["images_encoded"] == 3  # no re-encode
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["mm_cache"]["hits"] >= 3


def test_prefix_hit_that_ends_mid_image_encodes_the_rest(family: tuple[Path, Reference]) -> None:
    """A second request shares a prefix that stops inside an image whose embeddings were evicted: the cached
    blocks are reused and only the image's remaining rows (every DeepStack level) are spliced in."""
    model_dir, reference = family
    engine = make_engine(model_dir, chunk_size=32, mm_cache_mb=0.0)
    first = chat("One.", [FIVE[1]])
    engine.generate([first], GREEDY)
    encoded = engine.stats()["images_encoded"]
    second = chat("Two.", [FIVE[1]])
    [out] = engine.generate([second], GREEDY)
    assert out.token_ids == reference.generate(second)
    hit = engine.stats()["prefix_cache_hit_tokens"]
    proc = engine.processor
    image = proc.process_image(FIVE[1])
    [span] = proc.build(proc.render(second), [image]).spans
    assert span.offset < hit < span.offset + span.length  # the reused prefix really stops inside the image
    # Nothing cached: encoded again, once, for the one chunk that holds the image's remaining rows.
    assert engine.stats()["images_encoded"] == encoded + 1


def test_cache_smaller_than_one_request(family: tuple[Path, Reference]) -> None:
    model_dir, reference = family
    messages = chat("Compare these five pages.", FIVE)
    engine = make_engine(model_dir, chunk_size=32, mm_cache_mb=0.02)
    [out] = engine.generate([messages], GREEDY)
    assert out.token_ids == reference.generate(messages)
    assert engine.stats()["mm_cache"]["bytes"] <= 0.02 * (1 << 20)


# The MoE has the dense model's vision tower and embedding rows: one run covers both.
@pytest.mark.parametrize("family", ["dense"], indirect=True)
def test_host_tier_reloads_every_deepstack_level(family: tuple[Path, Reference]) -> None:
    """A GPU tier of 48 KiB holds two of the three images (41, 6 and 5 KiB with their DeepStack levels): the one it
    evicts spills to the host tier and comes back, main embedding and every level, for a second request (no prefix
    cache, so it reads them again) without a re-encode."""
    model_dir, reference = family
    engine = make_engine(model_dir, chunk_size=32, mm_cache_mb=48 / 1024, mm_host_cache_mb=1,
                         enable_prefix_caching=False)
    for question in ("Compare these three pages.", "Which one is darkest?"):
        messages = chat(question, FIVE[:3])
        [out] = engine.generate([messages], GREEDY)
        assert out.token_ids == reference.generate(messages)
    stats = engine.stats()
    assert stats["images_encoded"] == 3 and stats["mm_host_cache"]["worker_reloads"] == 2


def test_unknown_architecture_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlavaForConditionalGeneration"]}')
    with pytest.raises(UnsupportedModel, match="LlavaForConditionalGeneration.*Qwen2_5_VLForConditionalGeneration"):
        load_spec(tmp_path)
