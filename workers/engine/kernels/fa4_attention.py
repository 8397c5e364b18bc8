"""FlashAttention-4 kernels (pip ``flash-attn-4``, import ``flash_attn.cute``; BSD-3): the LM's eager steps
through ``paged_varlen.PagedVarlenBackend`` and the ViT's full-attention blocks, as the FA3 backend does, with the
kernel from a maintained package on the index instead of a build of vLLM's private fork.

FA4 is written in CuTe DSL (``nvidia-cutlass-dsl``) and compiled on first use for the head size, dtype and masks
it meets; it serves Hopper (sm90) and Blackwell (sm100) GPUs. Its varlen call takes the paged KV cache in place in
our layout ([num_blocks, block_size, Hkv, D] with an int32 page table). Its contract differs from the fork's in
names and in how an unbounded window is written (None, not -1): the adapters below take the contract the backend
and the ViT layer call.

``auto``'s first choice where it serves: on an H200 (docs/benchmarks.md, session 39) its steps ran 1.15-2.17x
torch's FlashAttention-2 (benchmarks/kernels/attn_bench.py ``--other fa4``) and the served (b) load gave 8.95
against 8.03-8.19 requests/s. A declared dependency; without it, or on another GPU, ``auto`` serves on
FlashAttention-2 and ``--attn-backend fa4`` logs why. Decode-only steps keep their CUDA graphs on the Triton
paged-decode kernel (paged_attention.py). Each kernel variant compiles on first use (about 20 s of the first
start-up on an H200) and is kept on disk for the next start.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels.attention import AttentionMetadata
from workers.engine.kernels.paged_varlen import Kernel, PagedVarlenBackend
from workers.engine.kernels.torch_attention import FlashVarlenBackend, leading_decodes

log = logging.getLogger(__name__)

ARCHES = (9, 10)  # compute capability majors FA4 compiles for: Hopper, Blackwell
# FA4 on Hopper loads a paged cache by TMA only where a block is one key tile: 128 tokens for heads up to 128, but its
# tiles of 256-wide heads are 80 keys (64 with a window), so Qwen3.5's and Gemma 4's 256-wide layers read 128-token
# blocks on its non-TMA path. Where such heads go: "pages" (FA4 on the blocks in place), "gather" (FA4 over a packed
# gather of the step's K/V, one copy of the keys a layer, outside sliding windows) or "flash" (the FlashAttention-2
# fallback). "pages" by measurement (H200, heads 16:4:256 in 128-token blocks, attn_bench --other fa4 --lm-heads
# 16:4:256): as fast as "gather" on chunks (0.761 against 0.745 ms for 2,100 new of 17,000 keys) and faster on steps
# with decode rows (0.231 against 0.288 ms for 64 of them beside a chunk), both 2.4-2.6x FlashAttention-2.
WIDE_HEADS = "GLIMPSE_FA4_WIDE_HEADS"
WIDE_HEAD_MODES = ("pages", "gather", "flash")
CACHE_FLAG, CACHE_DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


@functools.cache
def _load() -> tuple[Any | None, str]:
    """FA4's ``flash_attn_varlen_func``, or None and why not."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in ARCHES:
        return None, "FlashAttention-4 needs a Hopper or Blackwell GPU (compute capability 9.x or 10.x)"
    # flash-attn-4 4.0.0b36 hands the CuTe DSL an AuxData argument the DSL takes as a compile-time value after a
    # UserWarning per kernel it compiles (a dozen at start-up): noise in the server's log, not a fault.
    warnings.filterwarnings("ignore", message=r"Argument aux_data .* cannot be converted to a JitArgument")
    # FA4 compiles each kernel variant at its first call; its on-disk cache (off unless asked for, read when
    # flash_attn.cute imports) lets a restart load them: start-up to /health 60.2 -> 36.1 s on an H200 (Qwen3-VL-8B
    # shape, session 40). Under ~/.cache rather than FA4's /tmp default so a service keeps it across reboots; an
    # operator's own setting of either variable wins.
    os.environ.setdefault(CACHE_FLAG, "1")
    os.environ.setdefault(CACHE_DIR, str(Path("~/.cache/glimpse/flash-attn-cute").expanduser()))
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:  # noqa: BLE001 - not installed, or its CuTe DSL cannot load here
        return None, f"flash_attn.cute does not import ({type(exc).__name__}: {exc}); pip install flash-attn-4"
    log.info("FlashAttention-4 from flash_attn.cute")
    return flash_attn_varlen_func, ""


def _side(size: int) -> int | None:
    return None if size < 0 else size


def paged_call(fn: Any) -> Kernel:
    """The backend's kernel contract (paged_varlen.Kernel) on FA4's ``flash_attn_varlen_func`` ``fn``."""

    def kernel(
        q: Tensor, k_cache: Tensor, v_cache: Tensor, max_seqlen_q: int, cu_seqlens_q: Tensor, max_seqlen_k: int, *,
        seqused_k: Tensor, block_table: Tensor, softmax_scale: float, causal: bool, fa_version: int = 3,
        window_size: tuple[int, int] = (-1, -1),
    ) -> Tensor:
        out, _ = fn(
            q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            seqused_k=seqused_k, page_table=block_table, softmax_scale=softmax_scale, causal=causal,
            window_size=(_side(window_size[0]), _side(window_size[1])),
        )
        result: Tensor = out
        return result

    return kernel


def packed_call(fn: Any) -> Any:
    """The ViT layer's packed call (non-causal within each ``cu_seqlens`` segment) on FA4's ``fn``."""

    def kernel(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float) -> Tensor:
        out, _ = fn(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                    max_seqlen_k=max_seqlen, softmax_scale=softmax_scale, causal=False)
        result: Tensor = out
        return result

    return kernel


def unavailable_reason(device: torch.device) -> str:
    """Empty when the FA4 backend can serve on ``device``."""
    if device.type != "cuda":
        return f"FlashAttention-4 needs a CUDA device, not {device.type}"
    return _load()[1]


def serves(name: str, device: torch.device | str) -> bool:
    """Whether attention backend ``name`` (``fa4``, or ``auto``: FA4 first) runs on FA4 on ``device``."""
    return name in ("fa4", "auto") and not unavailable_reason(torch.device(device))


def vision_kernel(name: str, device: torch.device | str) -> Any | None:
    """FA4's packed call for the ViT's full blocks when the model's attention runs on FA4, else None."""
    return packed_call(_load()[0]) if serves(name, device) else None


class FA4PagedBackend(PagedVarlenBackend):
    """The LM's attention on FA4 (``fn``: a stand-in of ``flash_attn_varlen_func`` in CPU tests).

    It takes what the shared backend takes (``max_head_dim`` 256, ``windows``), as checked against SDPA on an H200
    (test_window_attention_backends.py, marked gpu): heads of 128 and 256 (Gemma 4's sliding layers), with and
    without a window, image spans included. FA4 asserts against heads of 512 (Gemma 4's global layers) on Hopper;
    they take the fallback before the call, so the refusal (which would move every later layer off FA4) never
    happens."""

    def __init__(self, fn: Any | None = None, any_device: bool = False) -> None:
        if fn is None:
            fn, reason = _load()
            if fn is None:
                raise RuntimeError(f"no FlashAttention-4 kernel: {reason}")
        super().__init__(paged_call(fn), "fa4", "FlashAttention-4", any_device)
        self._fn = fn
        self.wide_heads = os.environ.get(WIDE_HEADS, "pages")
        if self.wide_heads not in WIDE_HEAD_MODES:
            raise ValueError(f"{WIDE_HEADS}={self.wide_heads!r}: expected one of {', '.join(WIDE_HEAD_MODES)}")
        self.wide_above = 128  # heads wider than this are "wide"

    def supports(self, q: Tensor) -> bool:
        return super().supports(q) and not (self.wide_heads == "flash" and q.shape[-1] > self.wide_above)

    def gathers(self, q: Tensor) -> bool:
        return self.wide_heads == "gather" and q.shape[-1] > self.wide_above

    def _packed(self, q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        """The step as the FlashAttention-2 backend runs it, on FA4: the leading decode rows through the Triton paged
        kernel (gathering a decode row's whole context for one query would cost more than its attention), the
        chunks after them on FA4's varlen call over their keys packed end to end (no page table), the causal mask
        aligned bottom-right as on the pages."""
        decodes, head, rest = leading_decodes(q, kv_cache, meta, scale, 0)
        if rest is None:
            assert head is not None
            return head
        k_all, v_all, cu_seqlens_k = FlashVarlenBackend.gather_packed_kv(kv_cache, rest)
        out, _ = self._fn(
            q[decodes:].contiguous(), k_all, v_all, cu_seqlens_q=rest.query_start_loc, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=rest.max_query_len, max_seqlen_k=rest.max_seq_len, softmax_scale=scale, causal=True,
        )
        chunks: Tensor = out
        return torch.cat([head, chunks]) if head is not None else chunks
