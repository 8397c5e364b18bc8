"""glimpse's Gemma 4 vision tower against transformers' Gemma4VisionModel + Gemma4MultimodalEmbedder (CPU, fp32).

The reference runs on what transformers' Gemma4ImageProcessor emits (rows padded to max_soft_tokens * k^2 with
position (-1, -1)); glimpse's tower gets the same rows without the padding and their (1, h, w) grids, image after
image, and must give transformers' soft tokens (``Gemma4Model.get_image_features``'s embed_vision output)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image  # noqa: E402  (after the skip: PIL comes with transformers' vision extras)
from torch import Tensor
from transformers.models.gemma4.modeling_gemma4 import (  # noqa: E402
    Gemma4MultimodalEmbedder,
    Gemma4VisionModel,
)

from workers.engine.kernels import fused
from workers.engine.models.gemma4.vision import Gemma4VisionTower, VisionSpec, build_vision
from workers.engine.models.loader import fill_dummy_weights

Grid = tuple[int, int, int]
PATCH = 4  # tiny patches: a few hundred per image at max_soft_tokens 70
TEXT_HIDDEN = 24
VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped queries
    "head_dim": 8,
    "patch_size": PATCH,
    "pooling_kernel_size": 3,
    "position_embedding_size": 256,  # past the longest side a 70-token image can have (210 patches)
    "rope_parameters": {"rope_theta": 100.0},
}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "clipped": {"use_clipped_linears": True, "standardize": True, "num_key_value_heads": 4},
}
# width x height: landscape, tall and thin, square-ish and odd
SIZES = ((120, 80), (40, 170), (97, 91))


def _config(variant: str) -> dict[str, Any]:
    return {"vision_config": {**VISION, **VARIANTS[variant]}, "text_config": {"hidden_size": TEXT_HIDDEN}}


@torch.no_grad()
def _reference(variant: str, seed: int = 0) -> tuple[Any, Any]:
    """transformers' vision model and embedder with every weight and buffer random, so each one's place in the math
    shows: matrices ~ unit-gain, norm weights 1 +- 0.3, clip bounds that clip a good share of the activations."""
    cfg = _config(variant)
    vcfg = transformers.Gemma4VisionConfig(**cfg["vision_config"])
    tcfg = transformers.Gemma4TextConfig(hidden_size=TEXT_HIDDEN)
    torch.manual_seed(seed)
    vision, embed = Gemma4VisionModel(vcfg).eval(), Gemma4MultimodalEmbedder(vcfg, tcfg).eval()
    for name, p in [*vision.named_parameters(), *embed.named_parameters()]:
        if name.endswith("position_embedding_table"):
            p.normal_(0.0, 1.0)
        elif p.ndim > 1:
            p.normal_(0.0, p.shape[-1] ** -0.5)
        else:
            p.uniform_(0.7, 1.3)
    for name, b in vision.named_buffers():
        if name.endswith(("input_min", "output_min")):
            b.fill_(-float(torch.empty(()).uniform_(0.8, 1.6)))
        elif name.endswith(("input_max", "output_max")):
            b.fill_(float(torch.empty(()).uniform_(0.8, 1.6)))
        elif name.endswith("std_bias"):
            b.normal_(0.0, 2.0)
        elif name.endswith("std_scale"):
            b.uniform_(0.5, 1.5)
    return vision, embed


def _hub_weights(vision: Any, embed: Any) -> list[tuple[str, Tensor]]:
    """The reference's state under the checkpoint's names (``model.`` stripped, as glimpse's loader hands them)."""
    return [(f"vision_tower.{n}", t) for n, t in vision.state_dict().items()] + [
        (f"embed_vision.{n}", t) for n, t in embed.state_dict().items()
    ]


def _images(seed: int = 0) -> list[Any]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]


def _processed(images: list[Any], max_soft_tokens: int) -> Any:
    proc = transformers.Gemma4ImageProcessor(patch_size=PATCH, max_soft_tokens=max_soft_tokens)
    return proc(images=images, return_tensors="pt")


def _unpadded(batch: Any) -> tuple[Tensor, list[Grid]]:
    """The processor's rows without padding, image after image, and their grids; checks the layout glimpse assumes
    (rows row-major over the patch grid: x = column, y = row)."""
    rows, grids = [], []
    for pixels, positions in zip(batch["pixel_values"], batch["image_position_ids"], strict=True):
        real = (positions != -1).all(-1)
        pos = positions[real]
        h, w = int(pos[:, 1].max()) + 1, int(pos[:, 0].max()) + 1
        index = torch.arange(h * w)
        assert torch.equal(pos, torch.stack((index % w, index // w), dim=-1))
        assert bool(real[: h * w].all()) and not bool(real[h * w :].any())  # the padding is all at the end
        rows.append(pixels[real])
        grids.append((1, h, w))
    return torch.cat(rows), grids


@torch.no_grad()
def _expected(vision: Any, embed: Any, batch: Any) -> Tensor:
    """Gemma4Model.get_image_features + embed_vision: the soft tokens of every image, concatenated."""
    hidden = vision(pixel_values=batch["pixel_values"], pixel_position_ids=batch["image_position_ids"])
    out: Tensor = embed(hidden.last_hidden_state)
    return out


def _tower(variant: str, weights: list[tuple[str, Tensor]], **kw: Any) -> Gemma4VisionTower:
    tower = build_vision(VisionSpec.from_hf_config(_config(variant)), dtype=torch.float32, device="cpu", **kw)
    tower.load_weights(weights)
    return tower


def _close(ours: Tensor, ref: Tensor, atol: float = 1e-5) -> None:
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert torch.allclose(ours, ref, atol=atol, rtol=atol), f"max |diff| {err}"


@pytest.mark.parametrize(("variant", "max_soft_tokens"), [("plain", 70), ("clipped", 140), ("plain", 280)])
def test_matches_transformers(variant: str, max_soft_tokens: int) -> None:
    vision, embed = _reference(variant)
    batch = _processed(_images(), max_soft_tokens)
    rows, grids = _unpadded(batch)
    tower = _tower(variant, _hub_weights(vision, embed))
    ours = tower(rows, grids)
    expected = _expected(vision, embed, batch)
    assert ours.shape == (sum(batch["num_soft_tokens_per_image"]), TEXT_HIDDEN)
    assert [tower.tokens_per_image(g) for g in grids] == list(batch["num_soft_tokens_per_image"])
    _close(ours, expected)


@pytest.mark.parametrize("variant", ["plain", "clipped"])
def test_compiled_layer_pieces_match_transformers(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's encoder layers (vision_fused.py: two compiled pieces around attention, clamps and norms
    folded in), compiled here on the CPU in float32 and taken as the tower takes them on CUDA: still transformers'
    soft tokens, and the pieces did run (the layers' own forward is never called)."""
    vision, embed = _reference(variant)
    batch = _processed(_images(), 70)
    rows, grids = _unpadded(batch)
    tower = _tower(variant, _hub_weights(vision, embed))
    assert fused.enable(tower) > 0
    monkeypatch.setattr(fused, "worth_it", lambda x: True)  # the tower's CUDA-only gate
    for layer in tower.vision_tower.encoder.layers:
        monkeypatch.setattr(layer, "forward", _never)
    _close(tower(rows, grids), _expected(vision, embed, batch))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layer_pieces_give_the_eager_towers_rows() -> None:
    """On CUDA in float32 the served path (fused on: the layer pieces, compiled for the card) gives the eager tower's
    rows, clipped variant, three images in one call."""
    vision, embed = _reference("clipped")
    batch = _processed(_images(), 70)
    rows, grids = _unpadded(batch)
    tower = build_vision(VisionSpec.from_hf_config(_config("clipped")), dtype=torch.float32, device="cuda")
    tower.load_weights(_hub_weights(vision, embed))
    eager = tower(rows.cuda(), grids)
    assert fused.enable(tower) > 0
    _close(tower(rows.cuda(), grids).cpu(), eager.cpu(), atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_recurring_cuda_calls_replay_a_graph_with_the_eager_rows() -> None:
    """layers/vit_graphs.py on the served path (bf16, fused pieces): the second call of the same grids is captured,
    the third replayed, each with other pixels, and every output is the eager tower's; other grids run eagerly."""
    vision, embed = _reference("clipped")
    rows, grids = _unpadded(_processed(_images(), 70))
    tower = build_vision(VisionSpec.from_hf_config(_config("clipped")), dtype=torch.bfloat16, device="cuda")
    tower.load_weights(_hub_weights(vision, embed))
    assert fused.enable(tower) > 0
    gen = torch.Generator().manual_seed(3)
    calls = [torch.rand(rows.shape, generator=gen).cuda() for _ in range(3)]
    eager = []
    tower.graphs.on = False
    for pixels in calls:
        eager.append(tower(pixels, grids))
    tower.graphs.on = True
    for pixels, want in zip(calls, eager, strict=True):
        _close(tower(pixels, grids).float().cpu(), want.float().cpu(), atol=1e-6)
    assert (tower.graphs.captured, tower.graphs.replays, len(tower.graphs)) == (1, 2, 1)
    tower(calls[0][: rows.shape[0] - grids[-1][1] * grids[-1][2]], grids[:-1])  # other grids: a first sighting
    assert (tower.graphs.captured, tower.graphs.replays) == (1, 2)


def _never(*args: Any) -> Tensor:
    raise AssertionError("the layer's eager forward ran instead of the compiled pieces")


def test_clip_bounds_and_standardization_take_part() -> None:
    """The clipped variant's bounds and std buffers are live: without them the output moves well past tolerance (so
    the comparison above would catch a tower that ignored them)."""
    vision, embed = _reference("clipped")
    batch = _processed(_images(), 70)
    rows, grids = _unpadded(batch)
    expected = _expected(vision, embed, batch)
    for dropped in (("input_min", "input_max", "output_min", "output_max"), ("std_bias", "std_scale")):
        weights = [(n, t) for n, t in _hub_weights(vision, embed) if not n.endswith(dropped)]
        tower = build_vision(VisionSpec.from_hf_config(_config("clipped")), dtype=torch.float32, device="cpu")
        with pytest.raises(ValueError, match="missing"):
            tower.load_weights(weights)
        # load what there is by hand; the dropped ones keep transformers' initial (neutral) values
        params = {**dict(tower.named_parameters()), **dict(tower.named_buffers())}
        with torch.no_grad():
            for name, t in weights:
                params[name].copy_(t.reshape(params[name].shape))
        assert (tower(rows, grids) - expected).abs().max().item() > 1e-2, dropped


def test_bfloat16_stays_near_float32() -> None:
    """The tower in bf16 (the GPU dtype) on the CPU: bf16 out, within bf16 noise of transformers' float32 rows."""
    vision, embed = _reference("clipped")
    batch = _processed(_images(), 70)
    rows, grids = _unpadded(batch)
    tower = build_vision(VisionSpec.from_hf_config(_config("clipped")), dtype=torch.bfloat16, device="cpu")
    tower.load_weights(_hub_weights(vision, embed))
    ours, expected = tower(rows, grids), _expected(vision, embed, batch)
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - expected).abs().max().item() < 0.03 * expected.abs().max().item()


def test_dummy_weights_run() -> None:
    """Built and filled the way ``--load-format dummy`` does (the loader's fill leaves buffers to the build)."""
    tower = build_vision(VisionSpec.from_hf_config(_config("clipped")), dtype=torch.float32, device="cpu")
    fill_dummy_weights(tower, seed=0)
    assert bool((tower.get_parameter("vision_tower.encoder.layers.0.self_attn.q_norm.weight") == 1).all())
    out = tower(torch.rand(6 * 9, 3 * PATCH * PATCH), [(1, 6, 9)])
    assert out.shape == (6, TEXT_HIDDEN) and bool(out.isfinite().all())


def test_ragged_batch_equals_one_by_one() -> None:
    vision, embed = _reference("plain", seed=1)
    tower = _tower("plain", _hub_weights(vision, embed))
    batch = _processed(_images(seed=1), 70)
    rows, grids = _unpadded(batch)
    # repeat a shape, so equal-length images share an attention call
    rows, grids = torch.cat((rows, rows[: grids[0][1] * grids[0][2]])), [*grids, grids[0]]
    together = tower(rows, grids)
    parts, start = [], 0
    for grid in grids:
        n = grid[1] * grid[2]
        parts.append(tower(rows[start : start + n], [grid]))
        start += n
    _close(together, torch.cat(parts), atol=1e-6)
    # The repeated image's rows match its first copy's. To rounding, not bitwise: with many CPU threads the GEMMs
    # split rows by position (an H200 host's 16 threads gave the copies different last bits; 2 threads did not).
    _close(together[-parts[-1].shape[0] :], together[: parts[0].shape[0]], atol=1e-6)
    # the plan of a repeated call is kept, and gives the same rows
    assert torch.equal(tower(rows, grids), together)


def test_load_weights_rejects_unknown_and_missing() -> None:
    vision, embed = _reference("plain")
    weights = _hub_weights(vision, embed)
    spec = VisionSpec.from_hf_config(_config("plain"))
    tower = build_vision(spec, dtype=torch.float32, device="cpu")
    assert tower.load_weights(weights) == {n for n, _ in weights}
    with pytest.raises(ValueError, match=r"unexpected or misshapen \['vision_tower.encoder.layers.0.bogus"):
        tower.load_weights([*weights, ("vision_tower.encoder.layers.0.bogus", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"missing \['embed_vision.embedding_projection.weight'\]"):
        tower.load_weights(weights[:-1])
    with pytest.raises(ValueError, match="misshapen"):
        tower.load_weights([(n, t[..., :-1] if n.startswith("embed_vision") else t) for n, t in weights])


def test_bad_grids_are_refused() -> None:
    vision, embed = _reference("plain")
    tower = _tower("plain", _hub_weights(vision, embed))
    with pytest.raises(ValueError, match="multiples of pooling_kernel_size"):
        tower(torch.zeros(4 * 6, 3 * PATCH * PATCH), [(1, 4, 6)])
    with pytest.raises(ValueError, match="grids say"):
        tower(torch.zeros(10, 3 * PATCH * PATCH), [(1, 3, 3)])
    assert tower(torch.zeros(0, 3 * PATCH * PATCH), []).shape == (0, TEXT_HIDDEN)


def test_spec_from_hub_config() -> None:
    """A 26B-A4B-shaped config.json: the vision fields, the LM width for the embedder, what ModelSpec reads."""
    cfg = {
        "text_config": {"hidden_size": 2816},
        "vision_config": {
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "head_dim": 72,
            "patch_size": 16,
            "pooling_kernel_size": 3,
            "position_embedding_size": 10240,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
            "hidden_activation": "gelu_pytorch_tanh",
            "use_clipped_linears": True,
            "standardize": True,
            "default_output_length": 280,
        },
    }
    spec = VisionSpec.from_hf_config(cfg)
    shape = (spec.hidden_size, spec.num_hidden_layers, spec.head_dim, spec.out_hidden_size)
    assert shape == (1152, 27, 72, 2816)
    assert spec.use_clipped_linears and spec.standardize and spec.rope_theta == 100.0
    seams = (spec.spatial_merge_size, spec.in_channels, spec.temporal_patch_size, spec.patch_size)
    assert seams == (3, 3, 1, 16)
    # missing keys: transformers' Gemma4VisionConfig defaults
    bare = VisionSpec.from_hf_config({"vision_config": {}, "text_config": {}})
    defaults = transformers.Gemma4VisionConfig()
    for field in fields(VisionSpec):
        if hasattr(defaults, field.name):
            assert getattr(bare, field.name) == getattr(defaults, field.name), field.name
    assert bare.rope_theta == defaults.rope_parameters["rope_theta"]
    assert bare.out_hidden_size == transformers.Gemma4TextConfig().hidden_size
    assert VisionSpec.from_hf_config({"vision_config": {"rope_theta": 50}}).rope_theta == 50.0
    with pytest.raises(ValueError, match="no vision tower"):
        VisionSpec.from_hf_config({"vision_config": None})
