"""flash-linear-attention's kernel choices at the Qwen3.5 shapes, shipped, so that a cold start does not autotune them.

fla autotunes each kernel of its chunked gated delta rule (2-12 candidate configs each) the first time a process
calls it at a head count, head dims and dtypes that Triton's caches have not seen. On a new host or container that
means compiling every candidate: a cold Qwen3.5-9B start on an H200 spent 17-20 s on six such autotunes (59
candidates) with the compiles on 16 threads (autotune_compiles.py), and ~6 s on one more in its state-snapshot
warm-up. fla itself can skip them: its ``CachedAutotuner`` looks a launch's tuning key up in ``{kernel}.json``
files under ``FLA_CONFIG_DIR`` when ``FLA_CACHE_MODE`` asks it to, and only autotunes on a miss.

glimpse ships such files per GPU architecture (``fla_configs/sm90``: Hopper), written on a card by
``python -m benchmarks.kernels.fla_configs`` (each autotune timed on a served prefill chunk's size) or by a served
start with ``GLIMPSE_FLA_CONFIG_DUMP=DIR`` (``dump``), and points fla at them before it first runs (``use_shipped``)
in ``strict`` mode: only a launch whose key matches exactly (heads, head dims, block sizes, dtypes) takes a shipped
config. fla's ``fuzzy`` mode would also hand a config chosen at other head dims to a new model, where it might not
fit the card's shared memory; a shape the files lack autotunes as before. Each file says which fla-core wrote it,
and the files are used only with that version installed (another may name its kernels' parameters otherwise). A
user's own ``FLA_CONFIG_DIR`` or ``FLA_CACHE_MODE`` (``disabled``: always autotune) is left as it is.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

log = logging.getLogger(__name__)

CONFIG_ROOT = Path(__file__).with_name("fla_configs")
DUMP_ENV = "GLIMPSE_FLA_CONFIG_DUMP"
MODE = "strict"


def arch_dir(device: torch.device) -> Path | None:
    """The shipped configs for ``device``'s architecture (``sm90``), or None where none are shipped."""
    major, minor = torch.cuda.get_device_capability(device)
    found = CONFIG_ROOT / f"sm{major}{minor}"
    return found if found.is_dir() else None


def use_shipped(device: torch.device) -> Path | None:
    """Point fla at the shipped configs for ``device`` (before or after fla is imported); the folder, or None where
    the user chose fla's config lookup themselves or none are shipped for this card."""
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ:
        return None
    found = arch_dir(device)
    if found is None:
        return None
    try:
        written = {json.loads(path.read_text()).get("fla_version") for path in found.glob("*.json")}
    except (OSError, ValueError, AttributeError) as exc:  # a damaged install: fla autotunes as it would without
        log.warning("fla kernel configs in %s unreadable (%s): fla autotunes its kernels", found, exc)
        return None
    if written != {installed := fla_version()}:  # another fla may name a kernel's parameters otherwise
        log.info("fla kernel configs in %s are fla-core %s's, this is %s: fla autotunes its kernels", found,
                 "/".join(sorted(map(str, written))), installed)  # fmt: skip
        return None
    os.environ["FLA_CONFIG_DIR"] = str(found)  # read at each lookup
    os.environ["FLA_CACHE_MODE"] = MODE  # read when fla's cache module is imported...
    imported: Any = sys.modules.get("fla.ops.utils.cache")
    if imported is not None:  # ...so where something imported fla first (transformers can), set its value too
        imported.FLA_CACHE_MODE = imported.FlaCacheMode(MODE)
    log.info("fla kernel configs: %s (%s)", found, MODE)
    return found


def fla_version() -> str | None:
    """The installed fla-core's version (without importing fla), or None."""
    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def key_hash(key: Iterable[Any]) -> str:
    """fla's name of a tuning key in a config file: the md5 of the key as compact JSON with sorted keys."""
    text = json.dumps(list(key), separators=(",", ":"), sort_keys=True)
    return hashlib.md5(text.encode()).hexdigest()


def config_entry(config: Any) -> dict[str, Any]:
    """A ``triton.Config`` as fla's config files hold it."""
    return {
        "kwargs": dict(config.kwargs),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "num_ctas": getattr(config, "num_ctas", 1),
        "maxnreg": getattr(config, "maxnreg", None),
    }


def fla_tuners() -> list[Any]:
    """fla's ``CachedAutotuner`` kernels among the modules this process imported, also where a decorator over the
    autotune (``triton.heuristics``) is what the module holds."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    found: dict[int, Any] = {}
    for module in _fla_modules():
        for value in vars(module).values():
            while isinstance(value, KernelInterface):
                if isinstance(value, Autotuner) and hasattr(value, "kernel_name"):
                    found[id(value)] = value
                value = getattr(value, "fn", None)
    return list(found.values())


def _fla_modules() -> list[ModuleType]:
    """fla's modules this process imported."""
    return [module for name, module in list(sys.modules.items()) if name == "fla" or name.startswith("fla.")]


def dump(dest: Path, tuners: Iterable[Any]) -> int:
    """Write each tuner's chosen configs (its ``cache``: tuning key -> config) into ``dest/{kernel_name}.json``,
    merged with the entries already there; how many entries were written."""
    import triton

    dest.mkdir(parents=True, exist_ok=True)
    written = 0
    for tuner in tuners:
        if not tuner.cache:
            continue
        path = dest / f"{tuner.kernel_name}.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        entries = data.get("autotune_entries") or {}
        for key, config in tuner.cache.items():
            entries[key_hash(key)] = {"autotune_key": list(key), "config": config_entry(config)}
            written += 1
        data.update(kernel_name=tuner.kernel_name, triton_version=triton.__version__, fla_version=fla_version(),
                    autotune_entries=entries)  # fmt: skip
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return written


def dump_if_asked() -> None:
    """``GLIMPSE_FLA_CONFIG_DUMP=DIR``: after start-up, the configs fla's autotunes chose in this process into DIR
    (the folder to ship as ``fla_configs/sm{major}{minor}`` for this card's architecture)."""
    dest = os.environ.get(DUMP_ENV, "").strip()
    if not dest or not _fla_modules():
        return
    try:
        written = dump(Path(dest), fla_tuners())
    except (OSError, TypeError, ValueError) as exc:  # a maintenance aid: never a reason not to serve
        log.warning("fla kernel configs not written to %s: %s", dest, exc)
        return
    log.info("fla kernel configs: %d entries written to %s", written, dest)
