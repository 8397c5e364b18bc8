"""Optional FlashAttention-3 kernels: the LM's eager steps (prefill chunks, mixed prefill + decode) and the ViT's
full-attention blocks.

torch 2.11's wheels carry FlashAttention-2 only, which runs the LM's prefill chunks at 250-330 TFLOP/s on an H200
(benchmarks/kernels/attn_bench.py); Hopper's FA3 kernels use its warpgroup MMA and TMA. The kernel comes from an installed
build of vLLM's FlashAttention fork (the ``vllm_flash_attn`` package: built on its own, or the copy vLLM's wheels
bundle; ``GLIMPSE_FA3_PATH`` names a folder holding it). Only its compiled op library is loaded: the fork's Python
imports vLLM, and no vLLM Python runs in glimpse. glimpse does not ship it and ``auto`` never loads it (``auto``
takes FlashAttention-4 from its declared package); ``--attn-backend fa3`` asks for it, and without a build logs why
and serves on the default backend.

The backend itself (one paged varlen call per LM step, windows, image spans, FP8 pages) is paged_varlen.py's, shared
with FlashAttention-4 (fa4_attention.py). The ViT's windows keep their own kernel (window_attention.py: FA3 is
slower at 64 patches).

Measured (docs/benchmarks.md, session 15; H100 and H200): served LM steps 2x FlashAttention-2, the ViT's full
blocks 1.5x cuDNN. Kept as an opt-in for hosts that have a build, beside the FA4 default.
CPU tests drive a plain-torch reference of the kernel's contract and a stand-in op library with the fork's schema;
the GPU tests (tests/workers/engine/kernels/test_fa3_attention.py) run where a build is installed.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels.paged_varlen import Kernel, PagedVarlenBackend

log = logging.getLogger(__name__)

PACKAGE = "vllm_flash_attn"  # the fork's package: standalone, or inside vLLM's install
LIBRARY = "_vllm_fa3_C"  # its compiled FA3 ops; loading the file registers torch.ops._vllm_fa3_C
# The fork's FA3 ``fwd`` op takes 37 arguments; these positions are the ones glimpse fills (besides q, k, v),
# checked by name against the loaded op's schema so that a build with another order is refused, not misfed.
FWD_ARITY = 37
FWD_NAMES = {7: "cu_seqlens_q", 11: "seqused_k", 12: "max_seqlen_q", 13: "max_seqlen_k", 14: "page_table",
             23: "softmax_scale", 24: "is_causal", 25: "window_size_left", 26: "window_size_right"}


def _candidates() -> list[tuple[str, Path]]:
    """Folders that may hold the fork's package, in order: an importable ``vllm_flash_attn``; the folder named by
    ``GLIMPSE_FA3_PATH`` (one holding ``vllm_flash_attn/``); the copy inside an installed vLLM. Only their
    compiled op library is loaded, never their Python: the fork's modules import vLLM (``vllm.platforms``), and
    vLLM's package import changes torch and environment settings."""
    found = [(f"import vllm_flash_attn at {folder}", folder) for folder in _package_folders(PACKAGE)]
    if folder := os.environ.get("GLIMPSE_FA3_PATH"):
        found.append(("GLIMPSE_FA3_PATH", Path(folder) / PACKAGE))
    found += [(f"vLLM at {folder}", folder / PACKAGE) for folder in _package_folders("vllm")]
    return found


def _package_folders(name: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(name)  # locates the package without running it
    except (ImportError, ValueError):
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []


def _library(package: Path) -> Path:
    files = sorted(package.glob(LIBRARY + "*.so"))
    if not files:
        raise FileNotFoundError(f"no {LIBRARY}*.so in {package}")
    return files[0]


def _fwd_op() -> Any:
    return getattr(torch.ops, LIBRARY).fwd


def _check_schema(op: Any) -> str:
    """Empty when the loaded ``fwd`` takes its arguments in the order ``varlen_kernel`` passes them."""
    names = [a.name for a in op.default._schema.arguments]
    wrong = [f"{i}: {names[i] if i < len(names) else None} (want {want})" for i, want in FWD_NAMES.items()
             if i >= len(names) or names[i] != want]
    if len(names) != FWD_ARITY or wrong:
        return f"{LIBRARY}.fwd has another signature ({len(names)} arguments; {', '.join(wrong) or 'names match'})"
    return ""


def _fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None, seqused_k: Tensor | None,
    max_seqlen_q: int, max_seqlen_k: int, page_table: Tensor | None, softmax_scale: float, causal: bool,
    window_size: tuple[int, int] = (-1, -1),
) -> Tensor:
    """The fork's FA3 op; the arguments glimpse does not use take the fork's defaults (no new KV, no rotary, no
    scaling, no softcap, heuristic splits). ``window_size`` (left, right): keys [i - left, i + right] of the query
    at (bottom-right aligned) position i, -1 unbounded."""
    outs = _fwd_op()(
        q, k, v, None, None, None, None,  # k_new, v_new, q_v, out
        cu_seqlens_q, cu_seqlens_k, None, None, seqused_k,  # cu_seqlens_k_new, seqused_q
        max_seqlen_q, max_seqlen_k, page_table,
        None, None, None, None, None,  # kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary
        None, None, None,  # q, k, v descale
        softmax_scale, causal, window_size[0], window_size[1], 0.0,  # window left, right; softcap
        True, None, 0, None, 0,  # rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin
        None, 1, 0, None,  # s_aux, cp_world_size, cp_rank, cp_tot_seqused_k
    )
    out: Tensor = outs[0]
    return out


def varlen_kernel(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, max_seqlen_q: int, cu_seqlens_q: Tensor, max_seqlen_k: int, *,
    seqused_k: Tensor, block_table: Tensor, softmax_scale: float, causal: bool, fa_version: int = 3,
    window_size: tuple[int, int] = (-1, -1),
) -> Tensor:
    """``flash_attn_varlen_func``'s paged call (the contract the backend and its tests use) on the FA3 op."""
    assert fa_version == 3
    return _fwd(q, k_cache, v_cache, cu_seqlens_q, None, seqused_k, max_seqlen_q, max_seqlen_k, block_table,
                softmax_scale, causal, window_size)


def packed_kernel(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float) -> Tensor:
    """Non-causal attention within packed segments (the ViT's windows or frames): ``q, k, v`` are [tokens, H, D]
    and segment i is rows ``cu_seqlens[i]:cu_seqlens[i + 1]``, as FlashAttention's varlen call takes them."""
    return _fwd(q, k, v, cu_seqlens, cu_seqlens, None, max_seqlen, max_seqlen, None, softmax_scale, False)


def serves(name: str, device: torch.device | str) -> bool:
    """Whether attention backend ``name`` runs on FA3: ``fa3`` only, where a build is found (``auto`` takes FA4,
    a maintained package, and never loads the fork's private library)."""
    return name == "fa3" and not unavailable_reason(torch.device(device))


def vision_kernel(name: str, device: torch.device | str) -> Kernel | None:
    """``packed_kernel`` for the ViT's full blocks when the model's attention runs on FA3, else None."""
    return packed_kernel if serves(name, device) else None


@functools.cache
def _load() -> tuple[Kernel | None, str]:
    """The FA3 varlen kernel, or None and why not (no build found, or no FA3 on this machine's GPU)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return None, "FA3 needs a Hopper GPU (compute capability 9.x)"
    reasons = []
    for where, package in _candidates():
        try:
            library = _library(package)
            torch.ops.load_library(str(library))
            reason = _check_schema(_fwd_op())
        except Exception as exc:  # missing, or a build that fails to load against this torch
            reasons.append(f"{where}: {type(exc).__name__}: {exc}")
            continue
        if reason:
            return None, f"{where}: {reason}"
        log.info("FlashAttention-3 from %s", library)
        return varlen_kernel, ""
    return None, "; ".join(reasons) or "no vllm_flash_attn found (install one, or set GLIMPSE_FA3_PATH)"


def unavailable_reason(device: torch.device) -> str:
    """Empty when the FA3 backend can serve on ``device``."""
    if device.type != "cuda":
        return f"FA3 needs a CUDA device, not {device.type}"
    return _load()[1]


class FA3PagedBackend(PagedVarlenBackend):
    """The LM's attention on the installed FA3 build (``kernel``: a stand-in of its contract in CPU tests)."""

    def __init__(self, kernel: Kernel | None = None, any_device: bool = False) -> None:
        if kernel is None:
            kernel, reason = _load()
            if kernel is None:
                raise RuntimeError(f"no FlashAttention-3 kernel: {reason}")
        super().__init__(kernel, "fa3", "FlashAttention-3", any_device)
