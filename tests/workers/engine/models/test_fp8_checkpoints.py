"""FP8 checkpoints of both published layouts served on the CPU: the engine's greedy tokens equal transformers' on the
same checkpoint dequantized, for Qwen2.5-VL, Qwen3-VL dense and MoE, the Qwen3.5 hybrid (MoE) and Gemma 4 dense and
MoE (each format three times).

The reference checkpoint is dequantized here by ``dequantize_dir``, a few independent lines (``torch.kron`` tiles,
not the engine's ``repeat_interleave``), and read by transformers as a plain float32 checkpoint. transformers 5.24's
own FP8 loaders need packages glimpse does not depend on: block FP8 (``FineGrainedFP8Config(dequantize=True)``)
raises "Loading an FP8 quantized model requires accelerate", and compressed-tensors needs the
``compressed-tensors`` package (installable, with loguru). Neither is added to the test environment for this one
comparison: what they would check is the dequantizing multiplication, which ``dequantize_dir`` writes out.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import noise_image
from tests.workers.engine.models.engine_harness import GREEDY, Reference, chat, make_engine
from workers.engine.kernels.fp8_quant import FP8

# (demo family, FP8 layout): every family, each layout on dense and sparse models.
CASES = [
    ("qwen2_5_vl", "fp8-dynamic"),  # Qwen dense, biased q/k/v
    ("qwen3_vl", "fp8-block"),  # Qwen dense, DeepStack
    ("qwen3_vl_moe", "fp8-dynamic"),  # Qwen MoE, stacked experts quantized per expert
    ("qwen3_5_moe", "fp8-block"),  # hybrid linear attention, per-expert FP8 tensors
    ("gemma4", "fp8-block"),  # Gemma 4 dense: K = V layers, per-layer inputs
    ("gemma4_moe", "fp8-dynamic"),  # Gemma 4: dense MLP and routed experts in every layer
]
IMAGE = noise_image(64, 48, seed=3)
MAX_NEW = 8


def dequantize_dir(src: Path, dst: Path) -> Path:
    """An FP8 checkpoint as a plain float32 one: each ``w`` with ``w_scale_inv`` (128 x 128 tiles) or ``w_scale``
    (per row) multiplied out, and ``quantization_config`` dropped."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith(("_scale_inv", "_scale")) and t.dtype != FP8 and name.rsplit("_scale", 1)[0] in tensors:
            continue
        if t.dtype == FP8:
            w = t.float()
            if name + "_scale_inv" in tensors:
                s = tensors[name + "_scale_inv"].float()
                tile = torch.ones(128, 128)
                w = torch.stack([x * torch.kron(sc, tile)[: x.shape[0], : x.shape[1]] for x, sc in
                                 zip(w.reshape(-1, *w.shape[-2:]), s.reshape(-1, *s.shape[-2:]))]).reshape(w.shape)
            else:
                w = w * tensors[name + "_scale"].float()
            t = w
        out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_greedy_tokens_equal_transformers_on_the_dequantized_checkpoint(
    family: str, fmt: str, fp8_demo: Callable[[str, str], Path], tmp_path: Path
) -> None:
    fp8_dir = fp8_demo(family, fmt)
    tensors = load_file(fp8_dir / "model.safetensors")
    assert sum(t.dtype == FP8 for t in tensors.values()) >= 8  # the language model really is FP8 on disk
    messages = chat("Describe the picture.", [IMAGE])
    expected = Reference(dequantize_dir(fp8_dir, tmp_path / "ref")).generate(messages, MAX_NEW)
    [got] = make_engine(fp8_dir).generate([messages], GREEDY)
    assert len(set(expected)) > 2  # a lively answer, not one repeated token
    assert got.token_ids[:MAX_NEW] == expected
