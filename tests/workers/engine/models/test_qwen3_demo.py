"""The Qwen3-VL and Qwen3-VL-MoE demo checkpoints: deterministic, in the Hub's layout, loadable by
transformers, and lively enough (varied, image-dependent greedy output; tokens spread over experts) for
greedy-equality tests of the serving engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoProcessor,
    AutoTokenizer,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)

from tests.workers.engine.models.demo_harness import DEMO_FILES, chat_inputs, greedy
from workers.engine.models.demo_writer import SPECIAL_TOKENS, THINK_TOKENS, TOOL_TOKENS
from workers.engine.models.qwen3_vl.demo import write_qwen3_vl, write_qwen3_vl_moe

ImageFactory = Callable[..., Image.Image]  # the `make_image` fixture from tests/conftest.py
WRITERS: dict[str, Callable[[Path], Path]] = {"qwen3_vl": write_qwen3_vl, "qwen3_vl_moe": write_qwen3_vl_moe}
MODEL_CLASSES: dict[str, Any] = {
    "qwen3_vl": Qwen3VLForConditionalGeneration,
    "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration,
}
EXPECTED_FILES = {*DEMO_FILES, "video_preprocessor_config.json"}
FAMILIES = pytest.mark.parametrize("family", sorted(WRITERS))
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, float]]:
    """Each family's checkpoint, written once for this module, with the seconds the write took."""
    out = {}
    for family, write in WRITERS.items():
        start = time.perf_counter()
        path = write(tmp_path_factory.mktemp(family) / "model")
        out[family] = (path, time.perf_counter() - start)
    return out


@pytest.fixture(scope="module")
def loaded(written: dict[str, tuple[Path, float]]) -> dict[str, tuple[Any, Any]]:
    """(processor, model) per family, loaded back from disk by transformers."""
    return {
        family: (AutoProcessor.from_pretrained(path), MODEL_CLASSES[family].from_pretrained(path).eval())
        for family, (path, _) in written.items()
    }


@FAMILIES
def test_fast_and_byte_identical(family: str, written: dict[str, tuple[Path, float]], tmp_path: Path) -> None:
    path, seconds = written[family]
    assert seconds < 10, seconds
    again = WRITERS[family](tmp_path / "again")
    assert {p.name for p in path.iterdir()} == EXPECTED_FILES
    assert {p.name for p in again.iterdir()} == EXPECTED_FILES
    for name in sorted(EXPECTED_FILES):
        assert (again / name).read_bytes() == (path / name).read_bytes(), name


@FAMILIES
def test_config_agrees_with_tokenizer(family: str, written: dict[str, tuple[Path, float]]) -> None:
    path, _ = written[family]
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.architectures == [MODEL_CLASSES[family].__name__]
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads) == (64, 3, 4)
    assert (text.num_key_value_heads, text.head_dim, text.intermediate_size) == (2, 16, 128)
    rope = text.rope_parameters
    assert rope["mrope_section"] == [2, 3, 3] and rope["mrope_interleaved"] and rope["rope_theta"] == 5e6
    assert sum(rope["mrope_section"]) * 2 == text.head_dim
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.intermediate_size) == (4, 32, 2, 64)
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (16, 2, 2)
    assert (vision.out_hidden_size, vision.num_position_embeddings) == (text.hidden_size, 64)
    assert list(vision.deepstack_visual_indexes) == [0, 2] and vision.hidden_act == "gelu_pytorch_tanh"
    assert not config.tie_word_embeddings and not text.tie_word_embeddings
    assert text.vocab_size % 64 == 0 and text.vocab_size >= len(tokenizer) > 2000
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + TOOL_TOKENS + THINK_TOKENS}
    assert len(set(ids.values())) == len(ids)
    assert (config.image_token_id, config.video_token_id) == (ids["<|image_pad|>"], ids["<|video_pad|>"])
    assert config.vision_start_token_id == ids["<|vision_start|>"]
    assert config.vision_end_token_id == ids["<|vision_end|>"]
    model = MODEL_CLASSES[family].from_pretrained(path)
    assert model.generation_config.eos_token_id == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert model.dtype == torch.float32
    if family == "qwen3_vl_moe":
        assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (8, 2, 48)
        assert (text.decoder_sparse_step, text.mlp_only_layers, text.norm_topk_prob) == (1, [], True)
        # The Hub's fused layout, not transformers' in-memory one (which is transposed).
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            experts = "model.language_model.layers.0.mlp.experts."
            assert f.get_slice(experts + "gate_up_proj").get_shape() == [8, 64, 2 * 48]
            assert f.get_slice(experts + "down_proj").get_shape() == [8, 48, 64]


def test_chat_template_follows_qwen3_vl(written: dict[str, tuple[Path, float]]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(written["qwen3_vl"][0])

    def render(messages: list[dict[str, Any]], prompt: bool = True, **kwargs: Any) -> str:
        out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt, **kwargs)
        return str(out)

    # No default system turn, unlike Qwen2.5-VL.
    hi = [{"role": "user", "content": "Hi"}]
    assert render(hi) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Compare "}, {"type": "image"}]
    parts.append({"type": "text", "text": " and "})
    parts += [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "video"}]
    assert render([{"role": "user", "content": parts}, {"role": "assistant", "content": "Same."}], False) == (
        f"<|im_start|>user\nCompare {IMAGE} and {IMAGE}<|video_pad|><|im_end|>\n"
        "<|im_start|>assistant\nSame.<|im_end|>\n"
    )

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
    ]
    rendered = render(messages, tools=[tool])
    assert rendered.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", ' in rendered
    assert rendered.endswith(
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    # As in Qwen3's tokenizer: one id each, and plain (not special) tokens that survive decoding.
    for token in TOOL_TOKENS + THINK_TOKENS:
        assert tokenizer.encode(token) == [tokenizer.convert_tokens_to_ids(token)]
    ids = tokenizer.encode('<tool_call>\n{"a": 1}\n</tool_call>')
    assert tokenizer.decode(ids, skip_special_tokens=True) == '<tool_call>\n{"a": 1}\n</tool_call>'


@FAMILIES
def test_image_token_layout_and_budget(
    family: str, loaded: dict[str, tuple[Any, Any]], make_image: ImageFactory
) -> None:
    processor, _ = loaded[family]
    inputs = chat_inputs(processor, [make_image(123, 77, seed=1)], "Describe it.")
    grid = inputs["image_grid_thw"].tolist()
    assert grid == [[1, 4, 8]]
    n_pads = 1 * 4 * 8 // 4
    assert processor.tokenizer.decode(inputs["input_ids"][0]) == (
        f"<|im_start|>user\n<|vision_start|>{'<|image_pad|>' * n_pads}<|vision_end|>Describe it.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    out = processor.image_processor(images=[make_image(2000, 1500), make_image(20, 20)], return_tensors="pt")
    tokens = (out["image_grid_thw"].prod(dim=-1) // 4).tolist()
    assert 200 < tokens[0] <= 256  # max = 256 merged 32x32 tiles
    assert tokens[1] == 4  # min = 2x2 merged tiles


@FAMILIES
def test_generate_depends_on_images(
    family: str, loaded: dict[str, tuple[Any, Any]], make_image: ImageFactory
) -> None:
    processor, model = loaded[family]
    text_only = greedy(processor, model, [], 12)[0]
    images = [make_image(123, 77, seed=1), make_image(300, 200, seed=2)]
    generated = greedy(processor, model, images, 12)[0]
    other = greedy(processor, model, [make_image(123, 77, seed=3), images[1]], 12)[0]
    for tokens in (text_only, generated, other):
        assert len(tokens) == 12
        # Greedy-equality tests are only as strong as the output is varied.
        assert len(set(tokens)) >= 9, tokens
    assert generated != other and generated != text_only
    # The very first answer token moves with the pixels of a single (odd-sized) image.
    firsts = set()
    for seed in range(4):
        with torch.inference_mode():
            logits = model(**chat_inputs(processor, [make_image(200, 130, seed=seed)])).logits
        firsts.add(int(logits[0, -1].argmax()))
    assert len(firsts) >= 2, firsts


def test_moe_router_spreads_tokens(loaded: dict[str, tuple[Any, Any]], make_image: ImageFactory) -> None:
    processor, model = loaded["qwen3_vl_moe"]
    picked: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: picked.append(out[2].flatten()))
        for layer in model.model.language_model.layers
    ]
    try:
        with torch.inference_mode():
            model(**chat_inputs(processor, [make_image(123, 77, seed=1), make_image(300, 200, seed=2)]))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(picked) == 3  # every layer is sparse (decoder_sparse_step 1, no mlp_only_layers)
    for layer_picks in picked:
        counts = torch.bincount(layer_picks, minlength=8)
        assert int((counts > 0).sum()) > 2, counts.tolist()
        assert int(counts.max()) < 0.5 * len(layer_picks), counts.tolist()  # no expert takes most picks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_experts_load_onto_cuda_as_onto_the_cpu(written: dict[str, tuple[Path, float]]) -> None:
    """On CUDA the fused Hub-layout expert stacks go to the GPU whole and are transposed there (qwen3_vl/moe.py
    ``whole_on_device``): every parameter equals the CPU load's, bit for bit."""
    from workers.engine.layers.linear import TPGroup
    from workers.engine.models import family as family_package, load_spec
    from workers.engine.models.load import load_model

    path = written["qwen3_vl_moe"][0]
    spec = load_spec(path)

    def load(device: str) -> dict[str, torch.Tensor]:
        built = family_package(spec.family).build(spec, TPGroup(), torch.float32, torch.device(device), "sdpa")
        return {name: p.detach().cpu() for name, p in load_model(built, path).named_parameters()}

    on_cpu, on_cuda = load("cpu"), load("cuda")
    assert on_cpu.keys() == on_cuda.keys() and any(".experts.gate_up_proj" in n for n in on_cpu)
    for name, value in on_cpu.items():
        assert torch.equal(value, on_cuda[name]), name
