"""Checkpoint reading: a shard that is missing or truncated is one clear CheckpointError (and one line from
`glimpse serve`), found from the headers before any weight is loaded; a sharded checkpoint loads whole."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
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


def test_tensors_moved_ahead_arrive_in_order_and_errors_reach_the_loader() -> None:
    """load.on_device_ahead: every tensor, in the checkpoint's order, on the device; a read that fails in the
    thread fails the load; a loader that stops early (its own error) leaves no thread behind."""
    import threading

    from workers.engine.models.load import on_device_ahead

    tensors = [(f"w{i}", torch.full((3,), float(i))) for i in range(5)]
    got = list(on_device_ahead(iter(tensors), torch.device("cpu")))
    assert [n for n, _ in got] == [n for n, _ in tensors]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, tensors, strict=True))

    def broken() -> Iterator[tuple[str, torch.Tensor]]:
        yield "w0", torch.zeros(1)
        raise CheckpointError("cannot read shard x: truncated")

    with pytest.raises(CheckpointError, match="truncated"):
        list(on_device_ahead(broken(), torch.device("cpu")))

    endless = ((f"w{i}", torch.zeros(1)) for i in range(10**9))
    stream = on_device_ahead(endless, torch.device("cpu"))
    assert next(stream)[0] == "w0"
    stream.close()  # the loader's error: the generator is closed, its thread told to stop and joined
    assert not any(t.name == "load-ahead" for t in threading.enumerate())
