from __future__ import annotations

import types

import pytest
import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

from workers.engine.models.mrope import mrope_positions

IMAGE = 7


def reference(ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    """transformers' own get_rope_index, called on a stand-in for the model."""
    cfg = Qwen2_5_VLConfig()
    cfg.vision_config.spatial_merge_size = 2
    fake = types.SimpleNamespace(config=cfg)
    fake.get_vision_position_ids = types.MethodType(Qwen2_5_VLModel.get_vision_position_ids, fake)
    input_ids = torch.tensor([ids])
    token_types = (input_ids == IMAGE).int()
    pos, delta = Qwen2_5_VLModel.get_rope_index(
        fake, input_ids, mm_token_type_ids=token_types, image_grid_thw=torch.tensor(grids)
    )
    return pos[:, 0], int(delta)


@pytest.mark.parametrize(
    "layout",
    [
        [("text", 5)],
        [("text", 3), ("image", (1, 4, 6)), ("text", 4)],
        [("image", (1, 2, 2)), ("text", 2), ("image", (1, 8, 4)), ("text", 2), ("image", (1, 6, 10)), ("text", 1)],
    ],
)
def test_positions_match_transformers(layout: list[tuple[str, object]]) -> None:
    ids: list[int] = []
    spans: list[tuple[int, int, tuple[int, int, int]]] = []
    for kind, value in layout:
        if kind == "text":
            assert isinstance(value, int)
            ids.extend([1] * value)
        else:
            assert isinstance(value, tuple)
            t, h, w = value
            n = t * h * w // 4
            spans.append((len(ids), n, (t, h, w)))
            ids.extend([IMAGE] * n)
    rows, delta = mrope_positions(len(ids), spans, merge=2)
    if not spans:
        assert rows == [list(range(len(ids)))] * 3 and delta == 0
        return
    ref, ref_delta = reference(ids, [s[2] for s in spans])
    assert torch.equal(torch.tensor(rows), ref)
    assert delta == ref_delta


def test_span_grid_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="does not match grid"):
        mrope_positions(10, [(0, 5, (1, 4, 4))], merge=2)
