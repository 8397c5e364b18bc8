"""``glimpse demo-model --quantize``: the FP8 demo checkpoints in the layouts their publishers use (tensor dtypes and
scale shapes, ``quantization_config``), with the vision tower, lm_head and routers left in the model dtype."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from server.cli import main
from workers.engine.kernels.fp8_quant import FP8


def test_cli_writes_qwen_block_fp8(tmp_path: Path) -> None:
    assert main(["demo-model", str(tmp_path / "m"), "--family", "qwen2_5_vl", "--quantize", "fp8-block"]) == 0
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    qc = json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "weight_block_size", "activation_scheme", "fmt")} == {
        "quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
    fp8 = {n for n, t in tensors.items() if t.dtype == FP8}
    assert fp8 and all(n.endswith(".weight") and ".layers." in n for n in fp8)
    for name in fp8:
        w, s = tensors[name], tensors[name + "_scale_inv"]
        assert s.dtype == torch.float32 and s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    kept = set(qc["modules_to_not_convert"])
    assert "lm_head" in kept and any(".visual." in m or m.startswith("visual.") for m in kept)
    assert all(n[: -len(".weight")] not in kept for n in fp8)
    assert tensors["lm_head.weight"].dtype == torch.float32


def test_compressed_tensors_layout(fp8_demo: Callable[[str, str], Path]) -> None:
    model_dir = fp8_demo("qwen3_vl_moe", "fp8-dynamic")
    tensors = load_file(model_dir / "model.safetensors")
    qc = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["quantization_status"]) == ("compressed-tensors", "float-quantized", "compressed")
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert {k: group["weights"][k] for k in ("num_bits", "type", "strategy", "dynamic", "symmetric")} == {
        "num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True}
    assert {k: group["input_activations"][k] for k in ("num_bits", "type", "strategy", "dynamic")} == {
        "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    assert {"lm_head", "re:.*visual.*", "re:.*mlp.gate$"} <= set(qc["ignore"])
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert tensors[q].dtype == FP8 and tensors[q + "_scale"].shape == (tensors[q].shape[0], 1)
    assert tensors[q + "_scale"].dtype == torch.float32  # the weight's own dtype, as llm-compressor saves it
    experts = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert tensors[experts].dtype == FP8 and tensors[experts + "_scale"].shape == (*tensors[experts].shape[:2], 1)
    assert tensors["model.language_model.layers.0.mlp.gate.weight"].dtype == torch.float32
    assert not any(t.dtype == FP8 for n, t in tensors.items() if "visual" in n)
