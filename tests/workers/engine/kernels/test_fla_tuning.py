"""fla_tuning.py: flash-linear-attention's kernel configs shipped per GPU architecture and pointed at before fla
runs, and written from a process's autotunes in fla's config-file format. On the CPU: the files' format (what fla's
``CachedAutotuner`` looks a launch's key up by), the switch and its respect for a user's own settings, the dump from
real Triton autotuners; on a GPU: a fresh process with an empty Triton cache runs the 9B's layer through fla and
times no candidate."""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from workers.engine.kernels import fla_tuning

REPO = Path(__file__).resolve().parents[4]


@triton.heuristics({"EVEN": lambda args: args["n"] % 64 == 0})
@triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w, num_stages=s)
                          for b, w, s in ((64, 2, 2), (128, 4, 3))], key=["n"])  # fmt: skip
@triton.jit
def copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def fla_hash(key: list[object]) -> str:
    """How fla names an entry (fla/ops/utils/cache.py, AutotuneKey.key_hash): md5 of compact, key-sorted JSON."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


@pytest.fixture
def fla_modules(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in fla module holding the heuristics-wrapped autotune, as fla's modules hold theirs."""
    module = types.ModuleType("fla.ops.stand_in")
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops.stand_in", module)
    module.copy_kernel = copy_kernel  # type: ignore[attr-defined]
    tuner = copy_kernel.fn
    assert isinstance(tuner, Autotuner)
    monkeypatch.setattr(tuner, "kernel_name", "copy_kernel", raising=False)
    monkeypatch.setattr(tuner, "cache", {})
    return module


def test_the_dump_writes_each_chosen_config_where_fla_looks_it_up(fla_modules: types.ModuleType,
                                                                   tmp_path: Path) -> None:
    tuner = copy_kernel.fn
    assert fla_tuning.fla_tuners() == [tuner]  # found under the heuristics decorator
    tuner.cache[(4096, "torch.bfloat16", True)] = tuner.configs[1]
    assert fla_tuning.dump(tmp_path, [tuner]) == 1
    tuner.cache.clear()
    tuner.cache[(512, "torch.float32", False)] = tuner.configs[0]
    assert fla_tuning.dump(tmp_path, [tuner]) == 1  # merged with the first entry, not in place of it
    data = json.loads((tmp_path / "copy_kernel.json").read_text())
    assert data["kernel_name"] == "copy_kernel" and data["triton_version"] == triton.__version__
    assert data["fla_version"] == fla_tuning.fla_version()  # None here, where fla-core is not installed
    entries = data["autotune_entries"]
    assert set(entries) == {fla_hash([4096, "torch.bfloat16", True]), fla_hash([512, "torch.float32", False])}
    assert entries[fla_hash([4096, "torch.bfloat16", True])] == {
        "autotune_key": [4096, "torch.bfloat16", True],
        "config": {"kwargs": {"BLOCK": 128}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None},
    }


def test_the_dump_is_asked_for_by_its_variable(fla_modules: types.ModuleType, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    copy_kernel.fn.cache[(64, "torch.bfloat16", True)] = copy_kernel.fn.configs[0]
    monkeypatch.delenv(fla_tuning.DUMP_ENV, raising=False)
    fla_tuning.dump_if_asked()
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(fla_tuning.DUMP_ENV, str(tmp_path / "sm90"))
    fla_tuning.dump_if_asked()
    assert (tmp_path / "sm90" / "copy_kernel.json").exists()


class FlaCacheMode(enum.Enum):  # fla's enum of lookup modes, the values it reads from FLA_CACHE_MODE
    DISABLED = "disabled"
    STRICT = "strict"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No user setting, a shipped folder for sm_90 only, and a card of the capability each test sets."""
    for name in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "sm90").mkdir()
    (tmp_path / "sm90" / "a_kernel.json").write_text(json.dumps({"fla_version": "0.6.0", "autotune_entries": {}}))
    monkeypatch.setattr(fla_tuning, "CONFIG_ROOT", tmp_path)
    monkeypatch.setattr(fla_tuning, "fla_version", lambda: "0.6.0")
    return tmp_path


def test_a_hopper_card_takes_the_shipped_folder_strictly(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    imported = types.ModuleType("fla.ops.utils.cache")  # fla imported earlier (transformers can): its mode set too
    imported.FlaCacheMode = FlaCacheMode  # type: ignore[attr-defined]
    imported.FLA_CACHE_MODE = FlaCacheMode.DISABLED  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", imported)
    assert fla_tuning.use_shipped(torch.device("cuda", 0)) == clean_env / "sm90"
    assert os.environ["FLA_CONFIG_DIR"] == str(clean_env / "sm90") and os.environ["FLA_CACHE_MODE"] == "strict"
    assert imported.FLA_CACHE_MODE is FlaCacheMode.STRICT


def test_other_cards_and_a_users_settings_are_left_alone(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fla_tuning.use_shipped(torch.device("cuda", 0)) is None
    assert "FLA_CONFIG_DIR" not in os.environ and "FLA_CACHE_MODE" not in os.environ
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fla_tuning, "fla_version", lambda: "0.7.0")  # another fla than the files were written by
    assert fla_tuning.use_shipped(torch.device("cuda", 0)) is None
    assert "FLA_CONFIG_DIR" not in os.environ and "FLA_CACHE_MODE" not in os.environ
    monkeypatch.setattr(fla_tuning, "fla_version", lambda: "0.6.0")
    (clean_env / "sm90" / "broken.json").write_text("{")  # a damaged install: fla autotunes, serving goes on
    assert fla_tuning.use_shipped(torch.device("cuda", 0)) is None
    assert "FLA_CONFIG_DIR" not in os.environ and "FLA_CACHE_MODE" not in os.environ
    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")  # the user wants fla to autotune
    assert fla_tuning.use_shipped(torch.device("cuda", 0)) is None
    assert "FLA_CONFIG_DIR" not in os.environ and os.environ["FLA_CACHE_MODE"] == "disabled"


def test_the_shipped_files_are_in_flas_format() -> None:
    """Every shipped entry is found by fla under its key (the hash matches), its config is a whole one, and every
    file was written by the fla-core that pyproject.toml's ``fla`` extra pins (a new pin needs new files)."""
    pinned = re.search(r'"fla-core==([^;"]+)', (REPO / "pyproject.toml").read_text())
    assert pinned is not None
    files = sorted(fla_tuning.CONFIG_ROOT.glob("*/*.json"))
    assert any(path.parent.name == "sm90" for path in files)
    for path in files:
        data = json.loads(path.read_text())
        assert data["kernel_name"] == path.stem and data["fla_version"] == pinned.group(1).strip(), path
        assert data["autotune_entries"], path
        for name, entry in data["autotune_entries"].items():
            assert name == fla_hash(entry["autotune_key"]), path
            config = entry["config"]
            assert isinstance(config["kwargs"], dict) and config["num_ctas"] == 1, path
            assert config["num_warps"] in (1, 2, 4, 8, 16, 32) and config["num_stages"] >= 1, path


NO_TUNING = """
import torch
from triton.runtime.autotuner import Autotuner
from workers.engine.kernels import gated_delta_fla

def refuse(*args, **kwargs):
    raise AssertionError("an autotune timed its candidates")

Autotuner._bench = refuse
assert gated_delta_fla.tune_shape(16, 32, 128, 128, torch.bfloat16)
print("untuned ok")
"""


@pytest.mark.gpu
def test_the_9b_layer_runs_through_fla_without_autotuning_on_hopper(tmp_path: Path) -> None:
    """A new process and an empty Triton cache (a new host): Qwen3.5-9B's linear-attention layer, called as a served
    start calls fla, times no candidate, as every autotune finds its shipped config."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper card (the shipped configs are sm_90's)")
    pytest.importorskip("fla")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    for name in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE", "TRITON_CACHE_AUTOTUNING"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", NO_TUNING], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0 and "untuned ok" in done.stdout, done.stderr[-3000:]
