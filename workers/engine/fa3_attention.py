"""Optional FlashAttention-3 backend for the LM's eager steps (prefill chunks, mixed prefill + decode).

torch 2.11's wheels carry FlashAttention-2 only, and on an H200 it runs the LM's prefill chunks at 250-330
TFLOP/s (benchmarks/attn_bench.py); Hopper's FA3 kernels use its warpgroup MMA and TMA. The kernel comes from
an installed build of vLLM's FlashAttention fork (the ``vllm_flash_attn`` package: built on its own, or the copy
vLLM's wheels bundle, loaded without importing vLLM; ``GLIMPSE_FA3_PATH`` names a folder holding it): glimpse does
not ship it, and without it ``--attn-backend fa3`` logs why and serves on the default backend.

One kernel call covers the whole step and reads the paged KV cache in place: every sequence's keys through its
block table up to ``seq_lens`` (``seqused_k``), the causal mask aligned bottom-right, GQA heads taken as they
are. Decode rows are sequences of one new token in the same call, so nothing is gathered or split. Pure-decode
steps keep their CUDA graphs (PaddedDecodeBackend), and the ViT keeps its own kernels.

Status: written against the fork's documented ``flash_attn_varlen_func`` contract and tested on the CPU with a
reference of that contract; its GPU test (tests/workers/engine/test_fa3_attention.py) runs where the kernel
is installed. Not yet measured end to end, so it is not picked by ``auto``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from workers.engine.attention import AttentionMetadata, FlashVarlenBackend, SdpaBackend, flash_available
from workers.engine.kv_write_kernel import write_kv_cache

log = logging.getLogger(__name__)

Kernel = Callable[..., Tensor]
PACKAGE = "vllm_flash_attn"  # the fork's package: standalone, or inside vLLM's install


def _candidates() -> list[tuple[str, Path | None]]:
    """Where to look for the fork's package, in order: importable as it is; the folder named by ``GLIMPSE_FA3_PATH``
    (one holding ``vllm_flash_attn/``); the copy inside an installed vLLM, loaded on its own so vLLM itself is
    never imported (its package import has side effects on torch and the environment)."""
    found: list[tuple[str, Path | None]] = [("import vllm_flash_attn", None)]
    if folder := os.environ.get("GLIMPSE_FA3_PATH"):
        found.append(("GLIMPSE_FA3_PATH", Path(folder) / PACKAGE))
    try:
        vllm = importlib.util.find_spec("vllm")  # locates the package without running it
    except (ImportError, ValueError):
        vllm = None
    for location in (vllm.submodule_search_locations or []) if vllm is not None else []:
        found.append((f"vLLM at {location}", Path(location) / PACKAGE))
    return found


def _import(package: Path | None) -> ModuleType:
    if package is None:
        return importlib.import_module(PACKAGE)
    if PACKAGE in sys.modules:  # loaded from an earlier candidate
        return sys.modules[PACKAGE]
    spec = importlib.util.spec_from_file_location(
        PACKAGE, package / "__init__.py", submodule_search_locations=[str(package)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"no package at {package}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module  # its own relative imports (the compiled ops) resolve through this name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[PACKAGE]
        raise
    return module


@functools.cache
def _load() -> tuple[Kernel | None, str]:
    """The fork's varlen entry point, or None and why not (no build found, or no FA3 on this machine's GPU)."""
    reasons = []
    for where, package in _candidates():
        try:
            module = _import(package)
            interface = importlib.import_module(PACKAGE + ".flash_attn_interface")
        except Exception as exc:  # missing, or a build that fails to load against this torch
            reasons.append(f"{where}: {type(exc).__name__}: {exc}")
            continue
        supported: Callable[[int], bool] | None = getattr(interface, "is_fa_version_supported", None)
        kernel: Kernel | None = getattr(module, "flash_attn_varlen_func", None)
        if kernel is None or supported is None:
            reasons.append(f"{where}: no flash_attn_varlen_func / is_fa_version_supported")
        elif not torch.cuda.is_available() or not supported(3):
            reasons.append(f"{where}: FA3 not supported on this device")
        else:
            log.info("FlashAttention-3 from %s", where)
            return kernel, ""
    return None, "; ".join(reasons)


def unavailable_reason(device: torch.device) -> str:
    """Empty when the FA3 backend can serve on ``device``."""
    if device.type != "cuda":
        return f"FA3 needs a CUDA device, not {device.type}"
    return _load()[1]


class FA3PagedBackend:
    """The LM's attention on FA3 with the KV cache read in place (see the module docstring).

    ``kernel`` follows ``flash_attn_varlen_func``'s contract; the default is the installed FA3 build. ``any_device``
    lets a CPU test drive a reference of that contract."""

    name = "fa3"

    def __init__(self, kernel: Kernel | None = None, any_device: bool = False) -> None:
        if kernel is None:
            kernel, reason = _load()
            if kernel is None:
                raise RuntimeError(f"no FlashAttention-3 kernel: {reason}")
        self._kernel, self._any_device = kernel, any_device
        self._fallback: Any = FlashVarlenBackend() if flash_available() else SdpaBackend()

    def supports(self, q: Tensor) -> bool:
        return (q.is_cuda or self._any_device) and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float
    ) -> Tensor:
        if not self.supports(q):
            return self._fallback.forward(q, k, v, kv_cache, meta, scale)  # writes the cache itself
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        out: Tensor = self._kernel(
            q.contiguous(), kv_cache[0], kv_cache[1],  # [num_blocks, block_size, Hkv, D]: the fork's paged layout
            meta.max_query_len, meta.query_start_loc, meta.max_seq_len,
            seqused_k=meta.seq_lens, block_table=meta.block_tables, softmax_scale=scale, causal=True,
            fa_version=3,
        )
        return out

