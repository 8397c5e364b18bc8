"""Checkpoint reading: a shard that is missing or truncated is one clear CheckpointError (and one line from
`glimpse serve`), found from the headers before any weight is loaded; a sharded checkpoint loads whole."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from workers.engine.models.loader import CheckpointError, check_checkpoint, iter_checkpoint


def sharded(demo_model_dir: Path, dest: Path) -> Path:
    """The demo checkpoint re-saved as three shards with an index, like a Hub checkpoint."""
    shutil.copytree(demo_model_dir, dest)
    (dest / "model.safetensors").unlink()
    tensors = dict(iter_checkpoint(demo_model_dir))
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(3):
        part = names[i::3]
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(dest / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dest


def test_sharded_checkpoint_reads_whole(demo_model_dir: Path, tmp_path: Path) -> None:
    ckpt = sharded(demo_model_dir, tmp_path / "ckpt")
    assert check_checkpoint(ckpt) == check_checkpoint(demo_model_dir) > 0
    ours = dict(iter_checkpoint(ckpt))
    for name, tensor in iter_checkpoint(demo_model_dir):
        assert torch.equal(ours[name], tensor)


def test_missing_shard_is_named(demo_model_dir: Path, tmp_path: Path) -> None:
    ckpt = sharded(demo_model_dir, tmp_path / "ckpt")
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"1 of 3 shards .* missing: model-00002-of-00003"):
        check_checkpoint(ckpt)


def test_truncated_shard_is_named(demo_model_dir: Path, tmp_path: Path) -> None:
    ckpt = sharded(demo_model_dir, tmp_path / "ckpt")
    shard = ckpt / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model-00003-of-00003.safetensors is truncated"):
        check_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="model-00003-of-00003"):
        list(iter_checkpoint(ckpt))
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(ckpt), "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "truncated" in lines[0], proc.stderr
