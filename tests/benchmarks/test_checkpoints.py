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
