"""Qwen2.5-VL M-RoPE with videos split into frame groups equals transformers' get_rope_index on the whole
video (one video_grid_thw row, its second_per_grid_ts), images and text around it."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

from workers.engine.models.video_mrope import video_mrope_delta, video_mrope_positions

TEXT, IMAGE, VIDEO = 0, 1, 2


def reference(layout: list[tuple[int, object]], tps: int) -> tuple[torch.Tensor, list[int]]:
    cfg = Qwen2_5_VLConfig()
    cfg.vision_config.spatial_merge_size = 2
    cfg.vision_config.tokens_per_second = tps
    fake = types.SimpleNamespace(config=cfg)
    fake.get_vision_position_ids = types.MethodType(Qwen2_5_VLModel.get_vision_position_ids, fake)
    types_: list[int] = []
    images, videos, seconds = [], [], []
    for kind, value in layout:
        if kind == TEXT:
            assert isinstance(value, int)
            types_ += [TEXT] * value
        elif kind == IMAGE:
            assert isinstance(value, tuple)
            images.append(value)
            types_ += [IMAGE] * (value[0] * value[1] * value[2] // 4)
        else:
            assert isinstance(value, tuple)
            grid, spg = value
            videos.append(grid)
            seconds.append(spg)
            types_ += [VIDEO] * (grid[0] * grid[1] * grid[2] // 4)
    ids = torch.zeros(1, len(types_), dtype=torch.long)
    pos, _ = Qwen2_5_VLModel.get_rope_index(
        fake, ids, mm_token_type_ids=torch.tensor([types_]),
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
        second_per_grid_ts=torch.tensor(seconds) if seconds else None,
    )
    return pos[:, 0], types_


@pytest.mark.parametrize(
    "layout",
    [
        [(TEXT, 4), (VIDEO, ((3, 8, 14), 1.2333)), (TEXT, 5)],
        [(TEXT, 2), (IMAGE, (1, 4, 6)), (TEXT, 3), (VIDEO, ((12, 4, 8), 1.0167)), (TEXT, 2), (VIDEO, ((2, 6, 6), 0.5)), (TEXT, 3)],
        [(VIDEO, ((5, 2, 2), 2.0)), (TEXT, 1)],
    ],
)
def test_groups_match_whole_video(layout: list[tuple[int, object]]) -> None:
    import numpy as np

    tps = 2
    ref, _ = reference(layout, tps)
    spans = []
    offset = 0
    for kind, value in layout:
        if kind == TEXT:
            assert isinstance(value, int)
            offset += value
        elif kind == IMAGE:
            assert isinstance(value, tuple)
            n = value[1] * value[2] // 4
            spans.append((offset, n, value, None))
            offset += n
        else:
            assert isinstance(value, tuple)
            (t, h, w), spg = value
            interval = np.float32(tps) * np.float32(spg)
            for g in range(t):
                n = h * w // 4
                spans.append((offset, n, (1, h, w), (g, int(np.float32(g) * interval))))
                offset += n
    rows, delta = video_mrope_positions(offset, spans, 2)
    assert torch.equal(torch.tensor(rows), ref)
    # Decoding continues from the prompt's last position (transformers' generate steps it by one).
    assert delta == int(ref[0, -1]) + 1 - offset == video_mrope_delta(offset, spans, 2)


def test_a_group_must_follow_its_video() -> None:
    with pytest.raises(ValueError, match="does not directly follow"):
        video_mrope_positions(20, [(0, 4, (1, 4, 4), (0, 0)), (6, 4, (1, 4, 4), (1, 2))], 2)
