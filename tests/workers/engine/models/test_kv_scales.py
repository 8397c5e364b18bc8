"""The FP8 KV cache's scales read from a checkpoint: the names vLLM reads (k_scale / v_scale, kv_scale,
compressed-tensors' k_proj.output_scale), per tensor or per head, each TP rank's heads, 1.0 where absent, and the
KV budget counted in the cache's bytes (FP8: twice bf16's blocks)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from workers.engine.config import EngineConfig
from workers.engine.models import load_spec
from workers.engine.models.kv_scales import load_kv_scales, scale_name
from workers.engine.runner.cache_memory import num_kv_blocks


def checkpoint(demo: Path, tmp: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """The demo's config with a checkpoint holding only ``tensors`` (the scales are all this reads)."""
    shutil.copy(demo / "config.json", tmp / "config.json")
    save_file(tensors, str(tmp / "model.safetensors"))
    return tmp


def test_names_vllm_reads_and_no_others() -> None:
    assert scale_name("model.layers.3.self_attn.k_scale") == (3, "k")
    assert scale_name("model.language_model.layers.0.self_attn.attn.v_scale") == (0, "v")
    assert scale_name("model.layers.1.self_attn.kv_scale") == (1, "kv")
    assert scale_name("model.layers.2.self_attn.v_proj.output_scale") == (2, "v")
    for other in ("model.layers.2.self_attn.k_proj.weight_scale", "model.layers.2.self_attn.k_proj.input_scale",
                  "model.visual.blocks.0.attn.k_scale", "model.layers.2.mlp.k_scale"):
        assert scale_name(other) is None, other


def test_per_tensor_per_head_and_defaults(demo_model_dir: Path, tmp_path: Path) -> None:
    """Demo: 3 layers, 2 KV heads. Layer 0 per tensor (k, v), layer 1 kv_scale for both, layer 2 per head V only."""
    model = checkpoint(demo_model_dir, tmp_path, {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(2.0),
        "model.layers.2.self_attn.v_proj.output_scale": torch.tensor([3.0, 4.0], dtype=torch.bfloat16),
    })
    spec = load_spec(model)
    scales = load_kv_scales(model, spec)
    assert [s.tolist() for s in scales] == [[[0.5, 0.5], [0.25, 0.25]], [[2.0, 2.0], [2.0, 2.0]],
                                            [[1.0, 1.0], [3.0, 4.0]]]
    # TP 2: each rank its own KV head's entries.
    assert [load_kv_scales(model, spec, 2, rank)[2].tolist() for rank in (0, 1)] == [[[1.0], [3.0]], [[1.0], [4.0]]]
    # TP 4 over 2 KV heads: each head replicated on two consecutive ranks.
    assert [load_kv_scales(model, spec, 4, rank)[2][1].item() for rank in range(4)] == [3.0, 3.0, 4.0, 4.0]
    assert all(s.eq(1.0).all() for s in load_kv_scales(None, spec))


def test_a_scale_of_another_head_count_is_refused(demo_model_dir: Path, tmp_path: Path) -> None:
    model = checkpoint(demo_model_dir, tmp_path, {"model.layers.0.self_attn.k_scale": torch.ones(3)})
    with pytest.raises(ValueError, match="3 entries; expected 1 or 2"):
        load_kv_scales(model, load_spec(model))


def test_gemma4_scales_follow_the_kv_owner_layers(gemma4_model_dir: Path, tmp_path: Path) -> None:
    model = checkpoint(gemma4_model_dir, tmp_path, {"model.language_model.layers.5.self_attn.k_scale": torch.tensor(7.0)})
    spec = load_spec(model)
    scales = load_kv_scales(model, spec)
    assert [tuple(s.shape) for s in scales] == [(2, h) for h, _ in spec.kv_shapes or ()]
    assert scales[-1][0].tolist() == [7.0] and all(s.eq(1.0).all() for s in scales[:-1])


@pytest.mark.parametrize("family", ["demo_model_dir", "gemma4_model_dir"])
def test_fp8_doubles_bf16_blocks_for_the_same_budget(family: str, request: pytest.FixtureRequest) -> None:
    spec = load_spec(request.getfixturevalue(family))
    cfg = EngineConfig(model="unused", kv_cache_mb=64)
    budget = 64 << 20
    bf16, fp8 = (num_kv_blocks(cfg, spec, dtype, 1, budget) for dtype in (torch.bfloat16, torch.float8_e4m3fn))
    assert fp8 == 2 * bf16 or fp8 == 2 * bf16 + 1  # floor division of the same budget
    assert EngineConfig(model="m", kv_cache_dtype="fp8").kv_torch_dtype() == torch.float8_e4m3fn
    assert EngineConfig(model="m", dtype="bfloat16").kv_torch_dtype() == torch.bfloat16
