"""glimpse's vision tower against transformers' Qwen2.5-VL vision model on a tiny random checkpoint (CPU, fp32)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from tests.workers.engine.models.vit_harness import encode_one_by_one
from workers.engine.models.qwen2_5_vl.vision import VisionSpec, VisionTower, load_vision

SIZES = [(57, 83), (300, 200), (123, 77), (640, 480), (29, 29)]  # (width, height) PIL sizes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A saved tiny Qwen2.5-VL checkpoint and the transformers model it came from."""
    cfg = transformers.Qwen2_5_VLConfig(
        vision_config=dict(
            depth=4,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[1, 3],
        ),
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=256,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        ),
    )
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF init leaves biases 0 and norms 1: perturb them so those paths are checked too
        for p in model.model.visual.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("qwen25vl_tiny")
    model.save_pretrained(path)
    return path, model


def _spec(path: Path) -> VisionSpec:
    return VisionSpec.from_hf_config(json.loads((path / "config.json").read_text()))


def _images(sizes: list[tuple[int, int]]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    from PIL import Image

    rng = np.random.RandomState(0)
    imgs = [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    proc = transformers.Qwen2VLImageProcessor(min_pixels=3136, max_pixels=200704)
    out = proc(images=imgs, return_tensors="pt")
    grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
    return out["pixel_values"].float(), grids  # type: ignore[return-value]


def _reference(model: Any, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    with torch.no_grad():
        return model.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output


def _load(path: Path, **kw: Any) -> VisionTower:
    return load_vision(path, _spec(path), dtype=torch.float32, device="cpu", **kw)


def test_spec_from_config(tiny: tuple[Path, Any]) -> None:
    spec = _spec(tiny[0])
    assert (spec.depth, spec.hidden_size, spec.num_heads, spec.out_hidden_size) == (4, 32, 2, 64)
    assert spec.fullatt_block_indexes == (1, 3) and spec.hidden_act == "silu" and spec.in_channels == 3
    # original Hub spelling of the input channels; bare vision_config dict accepted too
    assert VisionSpec.from_hf_config({"in_chans": 4, "depth": 2}).in_channels == 4


def test_patch_embed_matmul_equals_conv3d(tiny: tuple[Path, Any]) -> None:
    tower = _load(tiny[0])
    pixels, _ = _images([(640, 480)])
    conv = tower.patch_embed.proj
    with torch.no_grad():
        ref = conv(pixels.view(-1, 3, 2, 14, 14)).view(pixels.shape[0], -1)
        torch.testing.assert_close(tower.patch_embed(pixels), ref, atol=1e-5, rtol=1e-5)


def test_one_image_matches_transformers(tiny: tuple[Path, Any]) -> None:
    path, model = tiny
    tower = _load(path)
    pixels, grids = _images([(640, 480)])
    # 13 x 18 merge units: 4 x 5 windows of 4 x 4 units, ragged right and bottom edges
    assert grids == [(1, 26, 36)]
    with torch.no_grad():
        ours = tower(pixels, grids)
    assert ours.shape == (tower.tokens_per_image(grids[0]), 64)
    torch.testing.assert_close(ours, _reference(model, pixels, grids), atol=1e-5, rtol=1e-5)


def test_many_images_match_transformers(tiny: tuple[Path, Any]) -> None:
    path, model = tiny
    tower = _load(path)
    pixels, grids = _images(SIZES)
    assert len(set(grids)) == len(SIZES)
    with torch.no_grad():
        ours = tower(pixels, grids)
    assert ours.shape[0] == sum(tower.tokens_per_image(g) for g in grids)
    torch.testing.assert_close(ours, _reference(model, pixels, grids), atol=1e-5, rtol=1e-5)


def test_video_grid_matches_transformers(tiny: tuple[Path, Any]) -> None:
    """t > 1: windows and full-attention segments are per frame."""
    path, model = tiny
    tower = _load(path)
    grids = [(3, 12, 20), (1, 8, 8)]
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = tower(pixels, grids)
    torch.testing.assert_close(ours, _reference(model, pixels, grids), atol=1e-5, rtol=1e-5)


def test_batched_equals_one_by_one(tiny: tuple[Path, Any]) -> None:
    tower = _load(tiny[0])
    pixels, grids = _images(SIZES)
    with torch.no_grad():
        batched = tower(pixels, grids)
    torch.testing.assert_close(batched, encode_one_by_one(tower, pixels, grids), atol=1e-5, rtol=1e-5)


def test_grid_cache_hit_on_repeat(tiny: tuple[Path, Any]) -> None:
    """A repeated call takes its whole plan as kept (no per-grid work at all); the same grids in another call list
    build that call's plan from the per-grid pieces; every answer equals a fresh tower's."""
    tower = _load(tiny[0])
    pixels, grids = _images(SIZES)
    with torch.no_grad():
        first = tower(pixels, grids)
        assert tower.stats["grid_misses"] == len(SIZES) and tower.stats["grid_hits"] == 0
        assert tower.stats["plan_hits"] == 0
        second = tower(pixels, grids)
        assert tower.stats["plan_hits"] == 1 and tower.stats["grid_hits"] == 0
        n = grids[0][0] * grids[0][1] * grids[0][2]
        alone = tower(pixels[:n], grids[:1])  # a new call list of a known grid: per-grid pieces reused
        fresh = _load(tiny[0])(pixels[:n], grids[:1])
    assert tower.stats["grid_hits"] == 1 and tower.stats["grid_misses"] == len(SIZES)
    assert tower.stats["plan_hits"] == 1 and len(tower.call_plans) == 2
    assert tower.stats["calls"] == 3 and tower.stats["images"] == 2 * len(SIZES) + 1
    assert tower.stats["patches"] == 2 * pixels.shape[0] + n
    assert torch.equal(first, second) and torch.equal(alone, fresh)


def test_kept_call_plans_stay_within_their_budget(tiny: tuple[Path, Any]) -> None:
    """Plans past the byte budget go least recently used first; one larger than the whole budget is not kept."""
    tower = _load(tiny[0])
    grids = [(1, 4, 4), (1, 4, 6), (1, 6, 4)]
    with torch.no_grad():
        tower(torch.zeros(16, 1176), [grids[0]])
        one = tower.call_plans.bytes
        tower.call_plans.budget = 2 * one + one // 2  # room for two plans of the smallest grid, not for three
        for g in grids[1:]:
            tower(torch.zeros(g[1] * g[2], 1176), [g])
        assert tower.call_plans.bytes <= tower.call_plans.budget and len(tower.call_plans) == 1  # 24-patch plans: one fits
        assert ((1, 6, 4),) in {key for key, _ in tower.call_plans._plans}
        tower.call_plans.budget = one - 1
        tower(torch.zeros(16, 1176), [grids[0]])
    assert len(tower.call_plans) == 1 and tower.call_plans.bytes <= 2 * one + one // 2  # the small plan did not fit
    assert tower.stats["plan_hits"] == 0


def test_rejects_mismatched_grids(tiny: tuple[Path, Any]) -> None:
    tower = _load(tiny[0])
    with pytest.raises(ValueError):
        tower(torch.zeros(10, 1176), [(1, 4, 4)])


def test_dummy_load_builds_and_runs(tiny: tuple[Path, Any], tmp_path: Path) -> None:
    spec = _spec(tiny[0])
    a = load_vision(tmp_path, spec, dtype=torch.float32, device="cpu", load_format="dummy")
    b = load_vision(tmp_path, spec, dtype=torch.float32, device="cpu", load_format="dummy")
    pixels, grids = _images([(300, 200), (29, 29)])
    with torch.no_grad():
        out = a(pixels, grids)
        assert torch.equal(out, b(pixels, grids))  # deterministic
    assert out.shape == (sum(a.tokens_per_image(g) for g in grids), spec.out_hidden_size)
    assert torch.isfinite(out).all()
    assert a.state_dict()["blocks.0.mlp.gate_proj.weight"].std().item() == pytest.approx(0.02, rel=0.2)


def test_load_handles_model_visual_prefix(tiny: tuple[Path, Any], tmp_path: Path) -> None:
    """transformers-5-style names (model.visual.*) load as well as the Hub's visual.*, sharded via an index."""
    from safetensors.torch import load_file, save_file

    src, _ = tiny
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {("model." + k if k.startswith("visual.") else k): v for k, v in tensors.items()}
    names = sorted(renamed)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for fname, keys in shards.items():
        save_file({k: renamed[k].contiguous() for k in keys}, str(tmp_path / fname))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ours = load_vision(tmp_path, _spec(src), dtype=torch.float32, device="cpu")
    ref = _load(src)
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), ref.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)


def test_parameter_names_match_transformers(tiny: tuple[Path, Any]) -> None:
    _, model = tiny
    tower = _load(tiny[0])
    assert set(tower.state_dict()) == set(model.model.visual.state_dict())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hot_after", [10**9, 0], ids=["full-blocks-flash", "full-blocks-cudnn"])
def test_flash_matches_sdpa_on_cuda(tiny: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch, hot_after: int) -> None:
    """The CUDA path (bf16: varlen FlashAttention for windows; FlashAttention or, once a frame length is hot,
    cuDNN for the full-attention blocks) against the grouped-SDPA path on the same card and weights."""
    from workers.engine.layers import vision_attention

    assert vision_attention.varlen_attn() is not None, "this torch has no torch.nn.attention.varlen"
    monkeypatch.setattr(vision_attention._cudnn_frames, "HOT_AFTER", hot_after)
    path, model = tiny
    pixels, grids = _images(SIZES)
    out = {}
    for backend in ("flash", "sdpa"):
        tower = load_vision(path, _spec(path), dtype=torch.bfloat16, device="cuda", attn_backend=backend)
        with torch.no_grad():
            out[backend] = tower(pixels.cuda(), grids).float().cpu()
    assert vision_attention._cudnn_frames.usable
    torch.testing.assert_close(out["flash"], out["sdpa"], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out["flash"], _reference(model, pixels, grids), atol=6e-2, rtol=6e-2)


def test_cudnn_frames_only_for_recurring_frame_lengths() -> None:
    """cuDNN builds a plan per sequence length (~37 ms), so a frame length goes to it only once it recurs."""
    from workers.engine.layers.vision_attention import Segments, _CudnnFrames

    frames = _CudnnFrames()
    two = Segments(torch.tensor([0, 100, 250]), [0, 100, 250], 150, frames=True)
    assert not any(frames.wants(two) for _ in range(frames.HOT_AFTER))
    assert frames.wants(two)  # both lengths (100, 150) are now hot
    fresh = Segments(torch.tensor([0, 100, 177]), [0, 100, 177], 100, frames=True)
    assert not frames.wants(fresh)  # 77 is new: the whole call stays on FlashAttention
    frames.usable = False
    assert not frames.wants(two)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_start_up_warm_up_of_cudnn_counts_no_length_and_gives_flashs_answer() -> None:
    """The warm-up's cuDNN calls (workers.engine.runner.warmup) leave every frame length's count alone, and at the ragged
    warm-up length cuDNN agrees with FlashAttention varlen on the same frame."""
    from workers.engine.layers import vision_attention as va

    attn = va.VisionAttention(hidden_size=1280, num_heads=16)
    seen = dict(va._cudnn_frames._seen)
    va.warm_cudnn_frames(attn, torch.device("cuda"), torch.bfloat16)
    assert va._cudnn_frames.usable and va._cudnn_frames._seen == seen
    length = va.WARM_LENGTHS[-1]
    q, k, v = (torch.randn(length, 16, 80, dtype=torch.bfloat16, device="cuda", generator=None) for _ in range(3))
    seg = va.Segments(torch.tensor([0, length], dtype=torch.int32, device="cuda"), [0, length], length, frames=True)
    torch.testing.assert_close(va._cudnn_frames(q, k, v, seg), va._varlen(q, k, v, seg), atol=2e-2, rtol=2e-2)
