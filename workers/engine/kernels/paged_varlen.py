"""The LM's attention on a FlashAttention varlen kernel that reads the paged KV cache in place: the backend shared by
FlashAttention-3 (fa3_attention.py, an installed build's op library) and FlashAttention-4 (fa4_attention.py, pip
``flash-attn-4``), which differ only in where their kernel comes from.

One kernel call covers the whole LM step: every sequence's keys through its block table up to ``seq_lens``
(``seqused_k``), the causal mask aligned bottom-right, GQA heads taken as they are. Decode rows are sequences of one
new token in the same call, so nothing is gathered or split. Sliding-window layers pass the window ``(window - 1,
0)``; rows inside an image span are recomputed by SDPA after the call (attention_masks.py). Pure-decode steps keep
their CUDA graphs (PaddedDecodeBackend).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels import kv_quant
from workers.engine.kernels.attention import AttentionMetadata, write_new_kv
from workers.engine.kernels.attention_masks import attend_span_rows, sequence_spans
from workers.engine.kernels.torch_attention import FlashVarlenBackend, SdpaBackend, flash_available

log = logging.getLogger(__name__)


def refusals() -> tuple[type[Exception], ...]:
    """What a FlashAttention kernel raises when it refuses a call (a head size or layout it was not built for): FA3's
    op raises RuntimeError, FA4's Python interface asserts, and its CuTe DSL raises its own errors (a compile or a
    driver it cannot use), which derive from Exception only. The DSL's are named once FA4 has imported it."""
    dsl = sys.modules.get("cutlass.base_dsl.common")
    base = getattr(dsl, "DSLBaseError", None)
    extra = (base,) if isinstance(base, type) and issubclass(base, Exception) else ()
    return (RuntimeError, AssertionError, ValueError, *extra)


# ``flash_attn_varlen_func``'s paged call: (q, k_cache, v_cache, max_seqlen_q, cu_seqlens_q, max_seqlen_k, *,
# seqused_k, block_table, softmax_scale, causal, fa_version, window_size) -> out [tokens, H, D].
Kernel = Callable[..., Tensor]


def dequantized_pages(
    kv_cache: Tensor, meta: AttentionMetadata, dtype: torch.dtype, name: str
) -> tuple[Tensor, Tensor]:
    """An FP8 cache as the kernel can read it: the blocks of the step's tables gathered and dequantized to ``dtype``
    (the kernels take e4m3 keys only beside e4m3 queries), [2, B * W, block_size, Hkv, D], and the table that reads them
    (sequence b's blocks at b * W ..). Costs a copy of the tables' blocks per layer: the price of FP8 on this path."""
    kv_quant.note_path(name, "over dequantized gathers of the step's blocks")
    batch, width = meta.block_tables.shape
    pages = kv_quant.dequantize_kv(kv_cache[:, meta.block_tables.long()].flatten(1, 2), kv_cache, dtype)
    table = torch.arange(batch * width, dtype=torch.int32, device=kv_cache.device).view(batch, width)
    return pages, table


class PagedVarlenBackend:
    """The LM's attention on ``kernel`` (``Kernel``'s contract) with the KV cache read in place (see the module
    docstring); ``name`` is the backend's, ``label`` the kernel's in log lines. ``any_device`` lets a CPU test drive
    a reference of the contract."""

    max_head_dim = 256  # wider heads (Gemma 4's global layers) take the fallback
    windows = True  # sliding-window layers on the kernel (else the fallback)
    honours_kv_written = True  # here and in the fallback (write_new_kv)

    def __init__(self, kernel: Kernel, name: str, label: str, any_device: bool = False) -> None:
        self.name, self.label = name, label
        self._kernel, self._any_device, self._refused = kernel, any_device, False
        self._fallback: Any = FlashVarlenBackend() if flash_available() else SdpaBackend()

    def supports(self, q: Tensor) -> bool:
        return ((q.is_cuda or self._any_device) and not self._refused
                and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= self.max_head_dim)

    def forward(
        self, q: Tensor, k: Tensor | None, v: Tensor | None, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
        window: int = 0, bidirectional: bool = False,
    ) -> Tensor:
        if not self.supports(q) or (window > 0 and not self.windows):  # writes the cache itself
            return self._fallback.forward(q, k, v, kv_cache, meta, scale, window, bidirectional)
        if k is not None and v is not None:
            write_new_kv(k, v, kv_cache, meta)
        # A sliding layer: the kernel keeps keys [i - left, i] (causal sets right to 0), ours i - window < j <= i.
        windowed = {"window_size": (window - 1, 0)} if window > 0 else {}
        pages, table = dequantized_pages(kv_cache, meta, q.dtype, self.name) if kv_quant.is_fp8(kv_cache) else (kv_cache, None)
        try:
            if table is None and not window and self.gathers(q):
                out: Tensor = self._packed(q, kv_cache, meta, scale)
            else:
                out = self._kernel(
                    q.contiguous(), pages[0], pages[1],  # [num_blocks, block_size, Hkv, D]: the fork's paged layout
                    meta.max_query_len, meta.query_start_loc, meta.max_seq_len,
                    seqused_k=meta.seq_lens, block_table=meta.block_tables if table is None else table,
                    softmax_scale=scale, causal=True,
                    fa_version=3, **windowed,
                )
        except refusals() as exc:
            log.warning("%s refused a step (%s: %s); the LM's attention runs on %s from now on", self.label,
                        type(exc).__name__, (str(exc).splitlines() or [""])[0][:200], self._fallback.name)
            self._refused = True
            # rewrites the same KV: harmless
            return self._fallback.forward(q, k, v, kv_cache, meta, scale, window, bidirectional)
        # The kernel's mask is causal (+ window); rows inside an image span also see the span's later keys.
        spans = sequence_spans(meta, bidirectional)
        if any(spans):
            attend_span_rows(out, q, kv_cache, meta, scale, window, spans)
        return out

    def gathers(self, q: Tensor) -> bool:
        """Whether this step's full-attention layers read a packed gather of the cache instead of the pages (a
        kernel that loads pages fast only at some block sizes; none here)."""
        return False

    def _packed(self, q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        raise NotImplementedError(f"{self.name} reads the pages in place")

