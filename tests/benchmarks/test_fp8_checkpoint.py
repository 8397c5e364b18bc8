"""benchmarks/tools/fp8_checkpoint.py: an FP8 copy of a sharded bf16 checkpoint has the tensors, index and config of
the same checkpoint quantized in place (demo_quantize), and glimpse loads it into the same model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.tools.fp8_checkpoint import INDEX, write_fp8_copy
from workers.engine.layers.linear import TPGroup
from workers.engine.models import family, load_spec
from workers.engine.models.demo_writer import write_demo_model
from workers.engine.models.load import load_model


def _sharded(src: Path, dest: Path) -> Path:
    """``src``'s one model.safetensors cut into two shards with an index, as save_pretrained writes large models."""
    dest.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, dest / file)
    weight_map = {n: file for file, part in halves.items() for n in part}
    (dest / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dest


def test_a_sharded_copy_matches_the_checkpoint_quantized_in_place(tmp_path: Path) -> None:
    plain = write_demo_model(tmp_path / "plain", "qwen3_vl_moe")
    in_place = write_demo_model(tmp_path / "in-place", "qwen3_vl_moe", "fp8-block")
    copy = tmp_path / "copy"
    assert len(write_fp8_copy(_sharded(plain, tmp_path / "sharded"), copy, "fp8-block", torch.device("cpu"))) == 2
    want = load_file(in_place / "model.safetensors")
    got: dict[str, torch.Tensor] = {}
    index = json.loads((copy / INDEX).read_text())["weight_map"]
    for shard in sorted(copy.glob("*.safetensors")):
        tensors = load_file(shard)
        assert all(index[n] == shard.name for n in tensors)
        got.update(tensors)
    assert sorted(got) == sorted(want) == sorted(index)
    assert any(n.endswith("experts.gate_up_proj_scale_inv") for n in got)  # the stacked experts, in tiles
    assert all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) if got[n].dtype == torch.float8_e4m3fn
               else torch.equal(got[n], want[n]) for n in want)
    config = json.loads((copy / "config.json").read_text())
    assert config["quantization_config"] == json.loads((in_place / "config.json").read_text())["quantization_config"]
    assert (copy / ".ok").exists()

    spec = load_spec(copy)
    models = [load_model(family(spec.family).build(spec, TPGroup(), torch.float32, torch.device("cpu"), "auto"), d)
              for d in (copy, in_place)]
    one, two = (m.state_dict() for m in models)
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
