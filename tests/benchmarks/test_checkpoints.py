"""The benchmarks' shaped checkpoints: each published shape's config.json is read by glimpse and by transformers as
that model (what the side-by-side runs load with random or dummy weights on the device)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from benchmarks.checkpoints import SHAPES, shaped_checkpoint
from workers.engine.models import load_spec


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shaped_checkpoints_read_as_the_published_model(shape: str, tmp_path: Path) -> None:
    family, fields, _ = SHAPES[shape]
    ckpt = shaped_checkpoint(tmp_path / shape, shape)
    assert not (ckpt / "model.safetensors").exists()  # config only: the weights are random or dummy
    spec = load_spec(ckpt)
    assert spec.family == family.removesuffix("_moe")
    assert (spec.hidden_size, spec.num_layers) == (fields["hidden_size"], fields["num_hidden_layers"])
    text = AutoConfig.from_pretrained(str(ckpt)).get_text_config()
    assert (text.hidden_size, text.vocab_size) == (fields["hidden_size"], fields["vocab_size"])
    if family.startswith("gemma4"):
        global_layers = [i for i, kind in enumerate(text.layer_types) if kind == "full_attention"]
        assert global_layers == list(range(5, fields["num_hidden_layers"], 6))
        assert set(spec.kv_shapes or ()) == {(fields["num_key_value_heads"], 256),
                                             (fields["num_global_key_value_heads"], 512)}
        assert spec.window == 1024


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-dynamic"])
def test_a_shape_can_be_written_as_an_fp8_checkpoint_with_fewer_layers(fmt: str, tmp_path: Path) -> None:
    """What benchmarks/serving/fp8_bench.py serves with dummy weights: the published FP8 repos' quantization_config
    on the same shape (the loader's dummy path then quantizes the random weights in that layout)."""
    from workers.engine.models.quantization import checkpoint_scheme

    ckpt = shaped_checkpoint(tmp_path / "q", "qwen3-8b", quantize=fmt, layers=3)
    scheme = checkpoint_scheme(ckpt)
    assert scheme is not None and scheme.name == fmt and scheme.block == (128 if fmt == "fp8-block" else None)
    assert load_spec(ckpt).num_layers == 3
    assert checkpoint_scheme(shaped_checkpoint(tmp_path / "b", "qwen3-8b")) is None
    with pytest.raises(ValueError, match="unknown FP8 format"):
        shaped_checkpoint(tmp_path / "x", "qwen3-8b", quantize="int4")
