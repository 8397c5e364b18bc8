"""An FP8 checkpoint's language model made FP8 while it loads (models/fp8_streaming.py, layers/deferred.py): the same
FP8 weights and scales as converting after a whole load, while no more than one decoder layer's weights exist in the
model dtype at a time. Run on the CPU by letting the loader build FP8 layers, as test_fp8_loading.py does."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from workers.engine.kernels import fp8_gemm
from workers.engine.layers.linear import TPGroup
from workers.engine.models import family, load, load_spec
from workers.engine.models.base import VLModel
from workers.engine.models.fp8_streaming import StreamingFp8


def _always(*_: Any) -> bool:
    return True


def _build(model_dir: Path, defer: bool) -> VLModel:
    spec = load_spec(model_dir)
    return family(spec.family).build(spec, TPGroup(), torch.float32, torch.device("cpu"), "auto",
                                     defer_lm_weights=defer)


def _layer_bytes(lm: nn.Module) -> dict[str, int]:
    """Bytes of the meta (deferred) parameters per decoder layer ("layers.N") and outside the layers ("")."""
    out: dict[str, int] = {}
    for name, p in lm.named_parameters():
        if p.is_meta:
            m = re.match(r"(layers\.\d+)\.", name)
            key = m.group(1) if m else ""
            out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out


@pytest.mark.parametrize(("demo", "fmt"), [("qwen3_5_moe", "fp8-block"), ("qwen3_vl_moe", "fp8-dynamic"),
                                           ("gemma4_moe", "fp8-block"), ("qwen3_vl", "fp8-block"),
                                           ("qwen2_5_vl", "fp8-dynamic"), ("gemma4", "fp8-dynamic"),
                                           ("qwen3_5", "fp8-block")])
def test_fp8_layers_made_while_loading_equal_those_made_after_it(
    demo: str, fmt: str, fp8_demo: Callable[[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = fp8_demo(demo, fmt)
    monkeypatch.setattr(fp8_gemm, "wants_fp8_layers", _always)
    monkeypatch.setattr(fp8_gemm, "grouped_usable", _always)
    assert load.defers_lm_weights(model_dir, "auto", torch.device("cpu"))
    assert not load.defers_lm_weights(model_dir, "dummy", torch.device("cpu"))
    streams: list[StreamingFp8] = []

    class Recorded(StreamingFp8):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            streams.append(self)

    monkeypatch.setattr(load, "StreamingFp8", Recorded)
    after = load.load_model(_build(model_dir, defer=False), model_dir)  # whole, then converted
    assert not streams
    deferred = _build(model_dir, defer=True)
    per_layer = _layer_bytes(deferred.lm)
    assert len(per_layer) >= 2 and "" not in per_layer  # only decoder layers' weights wait, all of them
    assert all(p.device.type == "cpu" for p in deferred.vision.parameters())  # the tower is built as always
    during = load.load_model(deferred, model_dir)
    [stream] = streams
    assert stream.converted > 0 and not stream.filling
    # At most one layer's weights were in the model dtype at once (the shards are written layer by layer).
    assert 0 < stream.peak_bytes <= max(per_layer.values()) < sum(per_layer.values()) // 2 + 1
    want, got = dict(after.lm.named_parameters()), dict(during.lm.named_parameters())
    assert want.keys() == got.keys()
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and not g.is_meta, name
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), name
    scales = [(n, m) for n, m in after.lm.named_modules() if getattr(m, "weight_scale", None) is not None
              or getattr(m, "gate_up_scale", None) is not None]
    assert len(scales) == stream.converted
    for name, module in scales:
        other = during.lm.get_submodule(name)
        for attr in ("weight_scale", "gate_up_scale", "down_scale"):
            if getattr(module, attr, None) is not None:
                assert torch.equal(getattr(module, attr), getattr(other, attr)), (name, attr)
