"""Qwen3.5's images and video against transformers on the demo checkpoints (CPU, float32), from one prompt its own
processor builds (an image, a video, text): the vision tower (Qwen3-VL's, without DeepStack) for the image and for
the video (whole, and frame group by frame group as the runner encodes it), the M-RoPE positions transformers'
``get_rope_index`` gives, and the logits of the whole multimodal prompt, prefilled in chunks that cut the image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.conftest import noise_image
from tests.videos import VideoReference, make_video, video_chat
from tests.workers.engine.models.qwen3_5_harness import (  # noqa: F401 (single_thread: an autouse fixture)
    HybridCache,
    load_ours,
    single_thread,
)
from workers.engine.models import family
from workers.engine.models.base import Span, VLModel

ATOL = 1e-3  # logits (std ~8, |max| ~35), measured max |diff| ~6.5e-4; the tower alone matches to 1e-5


@pytest.fixture(scope="module", params=["dense", "moe"])
def case(request: pytest.FixtureRequest) -> tuple[VLModel, Any, Any]:
    """(glimpse's model, transformers' model, the processor's inputs for an image + video + text prompt)."""
    model_dir: Path = request.getfixturevalue("qwen3_5_moe_model_dir" if request.param == "moe" else "qwen3_5_model_dir")
    reference = VideoReference(model_dir)
    messages = video_chat("What changes?", [make_video(frames=9, width=150, height=90, fps=4)],
                          images=[noise_image(120, 70, seed=3)])
    return load_ours(model_dir), reference.model, reference.inputs(messages)


def spans(ours: VLModel, inputs: Any) -> list[Span]:
    """The prompt's image and video-frame-group spans as glimpse's prompt builder lays them out: each run of image or
    video pads is one item; a video's frame groups are one-frame items, in order."""
    ids = inputs["input_ids"][0].tolist()
    grids = {ours.spec.image_token_id: [tuple(g) for g in inputs["image_grid_thw"].tolist()],
             ours.spec.video_token_id: [(1, h, w) for t, h, w in inputs["video_grid_thw"].tolist() for _ in range(t)]}
    out: list[Span] = []
    i = 0
    while i < len(ids):
        if ids[i] in grids:
            j = i
            while j < len(ids) and ids[j] == ids[i]:
                j += 1
            t, h, w = grids[ids[i]].pop(0)
            out.append((i, j - i, (t, h, w), None if ids[i] == ours.spec.image_token_id else (len(out), 0)))
            i = j
        else:
            i += 1
    assert not any(grids.values())
    return out


def test_tower_equals_transformers_for_image_and_video(case: tuple[VLModel, Any, Any]) -> None:
    ours, hf, inputs = case
    assert ours.vision.embed_width == ours.spec.hidden_size and not len(ours.vision.deepstack_merger_list)
    for pixels, grid in ((inputs["pixel_values"], inputs["image_grid_thw"]),
                         (inputs["pixel_values_videos"], inputs["video_grid_thw"])):
        with torch.no_grad():
            expected = hf.model.visual(pixels, grid_thw=grid).pooler_output
            whole = ours.encode(pixels, [tuple(g) for g in grid.tolist()])
        torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    # A video's frame groups one item each (the runner's media items): the same rows.
    (t, h, w), = inputs["video_grid_thw"].tolist()
    assert t > 1
    with torch.no_grad():
        groups = ours.encode(inputs["pixel_values_videos"], [(1, h, w)] * t)
    torch.testing.assert_close(groups, whole, atol=1e-5, rtol=1e-5)


def test_positions_equal_get_rope_index(case: tuple[VLModel, Any, Any]) -> None:
    ours, hf, inputs = case
    ids = inputs["input_ids"][0]
    fam = family("qwen3_5")
    rows, delta = fam.positions(len(ids), spans(ours, inputs), ours.spec.spatial_merge_size)
    expected, deltas = hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"], inputs["video_grid_thw"]
    )
    assert torch.equal(torch.tensor(rows), expected[:, 0])
    assert delta == int(deltas[0]) == fam.delta(len(ids), spans(ours, inputs), ours.spec.spatial_merge_size)


def test_multimodal_prompt_logits_equal_transformers(case: tuple[VLModel, Any, Any]) -> None:
    """Image and video embeddings spliced into the prompt, M-RoPE rows, prefilled in 3 chunks (the first ends inside
    the image): every position's logits as transformers' one forward over the processor's inputs."""
    ours, hf, inputs = case
    ids: Tensor = inputs["input_ids"][0]
    items = spans(ours, inputs)
    rows, _ = family("qwen3_5").positions(len(ids), items, ours.spec.spatial_merge_size)
    with torch.no_grad():
        media = torch.cat([ours.encode(inputs["pixel_values"], [tuple(inputs["image_grid_thw"][0].tolist())]),
                           ours.encode(inputs["pixel_values_videos"], [s[2] for s in items[1:]])])
        embeds = ours.embed(ids)
        mm_rows = torch.cat([torch.arange(o, o + n) for o, n, *_ in items])
        ours.splice(embeds, mm_rows, media)
        expected = hf(**inputs).logits[0]
    cache = HybridCache(ours.lm)
    image_mid = items[0][0] + items[0][1] // 2
    cuts = [0, image_mid, image_mid + 17, len(ids)]
    got = [cache.step([("p", ids[a:b])], positions={"p": torch.tensor(rows)}, embeds={"p": embeds})[0]
           for a, b in zip(cuts, cuts[1:], strict=False)]
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)
