"""glimpse's Qwen3-VL vision tower against transformers' Qwen3VLVisionModel on a tiny random model (CPU, fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from tests.workers.engine.models.vit_harness import encode_one_by_one
from workers.engine.models.qwen3_vl.vision import VisionSpec, VisionTower, build_vision

Grid = tuple[int, int, int]
PATCH_DIM = 3 * 2 * 16 * 16
ODD_GRIDS: list[Grid] = [(1, 4, 6), (1, 8, 4), (1, 2, 2), (2, 6, 6)]  # the video repeats its frame shape
VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,  # an 8 x 8 learned grid, interpolated up and down
    deepstack_visual_indexes=[0, 2],
)


@pytest.fixture(scope="module")
def reference() -> Any:
    """transformers' vision model with every parameter random (HF init leaves norms 1 and biases 0)."""
    torch.manual_seed(0)
    model = transformers.Qwen3VLVisionModel(transformers.Qwen3VLVisionConfig(**VISION)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:  # ~unit-variance activations, so attention and the GELUs are far from linear
                p.normal_(0.0, p[0].numel() ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.2)
    return model


def _spec() -> VisionSpec:
    return VisionSpec.from_hf_config({"vision_config": VISION})


def _tower(reference: Any, **kw: Any) -> VisionTower:
    tower = build_vision(_spec(), dtype=torch.float32, device="cpu", **kw)
    tower.load_weights(reference.state_dict().items())
    return tower


def _pixels(grids: list[Grid], seed: int = 0) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


def _expected(reference: Any, pixels: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
    """[main merger output, DeepStack level 0, level 1, ...] as transformers computes them."""
    with torch.no_grad():
        out = reference(pixels, grid_thw=torch.tensor(grids))
    return [out.pooler_output, *out.deepstack_features]


def _check(ours: torch.Tensor, expected: list[torch.Tensor]) -> None:
    assert ours.shape == (expected[0].shape[0], 64 * len(expected))
    for level, (mine, ref) in enumerate(zip(ours.split(64, dim=-1), expected, strict=True)):
        err = (mine - ref).abs().max().item()
        assert torch.allclose(mine, ref, atol=1e-5, rtol=1e-5), f"level {level} (0 = main): max |diff| {err}"


def test_spec_from_config() -> None:
    spec = _spec()
    shape = (spec.depth, spec.hidden_size, spec.num_heads, spec.out_hidden_size, spec.patch_size)
    assert shape == (4, 32, 2, 64, 16)
    assert spec.deepstack_visual_indexes == (0, 2) and spec.num_position_embeddings == 64
    assert VisionSpec.from_hf_config(VISION) == spec  # the bare vision_config works too
    full = transformers.Qwen3VLConfig().to_dict()  # defaults are transformers' defaults
    assert VisionSpec.from_hf_config(full) == VisionSpec()
    default = VisionSpec()
    assert default.hidden_act == "gelu_pytorch_tanh" and default.deepstack_visual_indexes == (8, 16, 24)


def test_parameter_names_match_transformers(reference: Any) -> None:
    tower = _tower(reference)
    assert set(tower.state_dict()) == set(reference.state_dict())
    assert tower.deepstack_levels == 2 and tower.embed_width == 64 * 3
    assert tower.tokens_per_image((2, 6, 6)) == 18


def test_interpolation_plan_equals_transformers() -> None:
    """Taps, weights and rotary positions bit-equal to transformers' helpers, in merge-unit patch order."""
    from transformers.vision_utils import (
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    tower = build_vision(_spec(), dtype=torch.float32, device="cpu")
    for grid in [(1, 10, 14), (1, 2, 2), (1, 24, 6)]:
        plan = tower._frame_plan(grid[1:])
        grid_thw = torch.tensor([grid])
        taps, weights = get_vision_interpolation_indices_and_weights(
            grid_thw, 8, mode="bilinear", align_corners=True, spatial_merge_size=2
        )
        assert torch.equal(plan.taps, taps) and torch.equal(plan.weights, weights)
        assert torch.equal(plan.positions, get_vision_position_ids(grid_thw, 2))


def test_one_image_matches_transformers(reference: Any) -> None:
    tower = _tower(reference)
    grids: list[Grid] = [(1, 10, 14)]
    pixels = _pixels(grids)
    with torch.no_grad():
        ours = tower(pixels, grids)
    _check(ours, _expected(reference, pixels, grids))


def test_many_images_match_transformers(reference: Any) -> None:
    """Odd grids packed in one call, a two-frame video among them, and a repeated shape (shared plan rows)."""
    tower = _tower(reference)
    for grids in [ODD_GRIDS, [(1, 4, 6), (2, 6, 6), (1, 4, 6)]]:
        pixels = _pixels(grids, seed=len(grids))
        with torch.no_grad():
            ours = tower(pixels, grids)
        _check(ours, _expected(reference, pixels, grids))


def test_fused_paths_match_transformers(reference: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA paths of fused.enable, run here in float32 on the CPU (every site taken, compiled functions run as
    written): the MLP's GEMM with its GELU in the epilogue among them, the tower gives transformers' answer."""
    from workers.engine.kernels import fused
    from workers.engine.models.qwen3_vl import vision

    monkeypatch.setattr(fused, "worth_it", lambda x: True)
    monkeypatch.setattr(fused, "compiled", lambda fn: fn)
    calls = 0

    def epilogue(bias: torch.Tensor, x: torch.Tensor, w: torch.Tensor, use_gelu: bool) -> torch.Tensor:
        """The op as cuBLASLt computes it on CUDA (tanh GELU; test_fused checks that there): its CPU kernel uses
        the erf GELU instead."""
        nonlocal calls
        calls += 1
        assert use_gelu
        return torch.nn.functional.gelu(torch.addmm(bias, x, w), approximate="tanh")

    monkeypatch.setattr(torch, "_addmm_activation", epilogue)
    tower = _tower(reference)
    fused.enable(tower)
    grids = ODD_GRIDS
    pixels = _pixels(grids, seed=7)
    with torch.no_grad():
        ours = tower(pixels, grids)
    _check(ours, _expected(reference, pixels, grids))
    assert calls == VISION["depth"]
    monkeypatch.setattr(vision, "GELU_EPILOGUE", False)  # the switch the benchmark turns
    with torch.no_grad():
        _check(tower(pixels, grids), _expected(reference, pixels, grids))
    assert calls == VISION["depth"]


def test_batched_rows_equal_alone(reference: Any) -> None:
    """A row slice of a packed call's output is that image's output alone (what the embedding cache relies on)."""
    tower = _tower(reference)
    pixels = _pixels(ODD_GRIDS)
    with torch.no_grad():
        batched = tower(pixels, ODD_GRIDS)
    torch.testing.assert_close(batched, encode_one_by_one(tower, pixels, ODD_GRIDS), atol=1e-5, rtol=1e-5)


def test_memoized_plan_gives_same_result(reference: Any) -> None:
    tower = _tower(reference)
    pixels = _pixels(ODD_GRIDS)
    with torch.no_grad():
        first = tower(pixels, ODD_GRIDS)
        assert tower.stats["grid_misses"] == 4 and tower.stats["grid_hits"] == 0  # 4 distinct frame shapes
        second = tower(pixels, ODD_GRIDS)  # the same call list: its whole plan was kept
        assert tower.stats["plan_hits"] == 1 and tower.stats["grid_hits"] == 0
        tower.call_plans.resize(0)  # none kept: the next call plans from the per-frame pieces
        third = tower(pixels, ODD_GRIDS)
    assert tower.stats["grid_misses"] == 4 and tower.stats["grid_hits"] == 4 and tower.stats["plan_hits"] == 1
    assert tower.stats["calls"] == 3 and tower.stats["patches"] == 3 * pixels.shape[0]
    assert torch.equal(first, second) and torch.equal(first, third)


def test_rejects_bad_input(reference: Any) -> None:
    tower = _tower(reference)
    with pytest.raises(ValueError, match="patches"):
        tower(torch.zeros(10, PATCH_DIM), [(1, 4, 4)])
    with pytest.raises(ValueError, match="multiples"):
        tower(torch.zeros(15, PATCH_DIM), [(1, 3, 5)])
    assert tower(torch.zeros(0, PATCH_DIM), []).shape == (0, 192)


def test_load_weights_names_missing_and_unexpected(reference: Any) -> None:
    tower = build_vision(_spec(), dtype=torch.float32, device="cpu")
    state = dict(reference.state_dict())
    loaded = tower.load_weights(state.items())
    assert loaded == set(state)
    del state["deepstack_merger_list.1.norm.bias"]
    with pytest.raises(ValueError, match=r"missing \['deepstack_merger_list\.1\.norm\.bias'\]"):
        tower.load_weights(state.items())
    state["deepstack_merger_list.1.norm.bias"] = torch.zeros(128)
    state["blocks.9.attn.qkv.weight"] = torch.zeros(96, 32)
    with pytest.raises(ValueError, match=r"unexpected or misshapen \['blocks\.9\.attn\.qkv\.weight"):
        tower.load_weights(state.items())
    state.pop("blocks.9.attn.qkv.weight")
    state["merger.linear_fc2.bias"] = torch.zeros(65)  # wrong shape
    with pytest.raises(ValueError, match=r"merger\.linear_fc2\.bias \(65,\)"):
        tower.load_weights(state.items())


def test_build_vision_allocates_in_dtype() -> None:
    tower = build_vision(_spec(), dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in tower.parameters()} == {torch.bfloat16}
    assert tower.rotary.inv_freq.dtype == torch.float32  # rotary angles stay float32 math
    tower.init_dummy()
    assert tower.state_dict()["blocks.0.norm1.weight"].eq(1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("backend", "fused_on", "hot_after"),
    [("flash", False, 10**9), ("flash", True, 0), ("sdpa", False, 10**9)],
    ids=["flash-varlen", "cudnn-fused", "sdpa"],
)
def test_cuda_bf16_matches_cpu_fp32(
    reference: Any, monkeypatch: pytest.MonkeyPatch, backend: str, fused_on: bool, hot_after: int
) -> None:
    from workers.engine.kernels import fused
    from workers.engine.layers import vision_attention

    monkeypatch.setattr(vision_attention._cudnn_frames, "HOT_AFTER", hot_after)
    grids: list[Grid] = [*ODD_GRIDS, (1, 24, 32)]
    pixels = _pixels(grids)
    with torch.no_grad():
        expected = _tower(reference)(pixels, grids)
        gpu = build_vision(_spec(), dtype=torch.bfloat16, device="cuda", attn_backend=backend)  # type: ignore[arg-type]
        gpu.load_weights(reference.state_dict().items())
        fused.enable(gpu, fused_on)
        with fused.forced() if fused_on else torch.no_grad():
            out = gpu(pixels.cuda(), grids).float().cpu()
    for mine, ref in zip(out.split(64, dim=-1), expected.split(64, dim=-1), strict=True):
        err = (mine - ref).norm() / ref.norm()
        assert err < 2e-2, f"relative error {err:.4f}"
