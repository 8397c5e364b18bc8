"""Paged-KV attention backends on torch's own kernels: SDPA, FlashAttention-2 varlen, and fixed-shape decode.

``SdpaBackend`` is the reference and the CPU path (a loop over sequences, each gathered from its blocks);
``FlashVarlenBackend`` serves CUDA steps, decodes in place through paged_attention and prefill chunks through
torch's FlashAttention-2 varlen kernel; ``PaddedDecodeBackend`` is the decode-only one whose shapes CUDA graphs
can capture. All of them take the metadata and follow the protocol of attention.py.

Sliding-window layers and image spans (Gemma 4; the rules in attention_masks.py): SDPA builds each sequence's mask
when a plain causal call cannot express it; the flash kernels take the window as FlashAttention's ``(window - 1, 0)``
and cannot take a span, so after them the rows inside a span are recomputed by SDPA (``attend_span_rows``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from workers.engine.kernels import kv_quant, paged_attention
from workers.engine.kernels.attention import (
    AttentionMetadata,
    decode_prefix,
    packed_kv_slots,
    tail_metadata,
    write_new_kv,
)
from workers.engine.kernels.attention_masks import (
    SequencePlan,
    attend_span_rows,
    gather_key_range,
    sequence_plan,
    sequence_spans,
    windowed_packed_kv_slots,
)


class SdpaBackend:
    """Reference backend: a loop over sequences, each gathered from its blocks, then torch SDPA.

    Works on any device and dtype; it is the CPU path and the fallback for everything else.
    """

    name = "sdpa"
    honours_kv_written = True

    def forward(
        self, q: Tensor, k: Tensor | None, v: Tensor | None, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
        window: int = 0, bidirectional: bool = False,
    ) -> Tensor:
        if k is not None and v is not None:
            write_new_kv(k, v, kv_cache, meta)
        if kv_quant.is_fp8(kv_cache):
            kv_quant.note_path(self.name, "over dequantized per-sequence gathers of the cache")
        out = torch.empty_like(q)
        gqa = q.shape[1] != kv_cache.shape[-2]
        start = 0
        for b, plan in enumerate(self._plans(meta, window, bidirectional, q.device)):
            q_len = meta.query_lens_cpu[b]
            k_b, v_b = gather_key_range(kv_cache, meta.block_tables[b], plan.first_key, meta.seq_lens_cpu[b], q.dtype)
            q_b = q[start : start + q_len].transpose(0, 1)  # [Hq, q_len, D]
            o = F.scaled_dot_product_attention(
                q_b,
                k_b.transpose(0, 1),
                v_b.transpose(0, 1),
                attn_mask=plan.mask,
                is_causal=plan.is_causal,
                scale=scale,
                enable_gqa=gqa,
            )
            out[start : start + q_len] = o.transpose(0, 1)
            start += q_len
        return out

    @staticmethod
    def _plans(meta: AttentionMetadata, window: int, bidirectional: bool, device: torch.device) -> list[SequencePlan]:
        """Each sequence's key range and mask; the same for every layer of this (window, bidirectional) kind, so the
        first such layer builds them and the others reuse them."""
        key = f"sdpa_plans:{window}:{bidirectional and meta.bidir_spans is not None}"
        plans: list[SequencePlan] | None = meta.derived.get(key)
        if plans is None:
            spans = sequence_spans(meta, bidirectional)
            plans = meta.derived[key] = [
                sequence_plan(q_len, s_len, window, spans[b], device)
                for b, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True))
            ]
        return plans


def _paged_decode_rows(
    q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float, window: int, decodes: int
) -> tuple[Tensor, AttentionMetadata | None]:
    """The step's first ``decodes`` rows (one new token each, K/V written) through the paged kernel, and the
    metadata of the sequences after them (None when every row was a decode)."""
    head = paged_attention.paged_decode(
        q[:decodes], kv_cache, meta.block_tables[:decodes], meta.seq_lens[:decodes], scale,
        max(meta.seq_lens_cpu[:decodes]), window=window,
    )
    if decodes == len(meta.seq_lens_cpu):
        return head, None
    rest = meta.derived.get("prefill_meta")
    if rest is None:
        rest = meta.derived["prefill_meta"] = tail_metadata(meta, decodes)
    return head, rest


def leading_decodes(
    q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float, window: int
) -> tuple[int, Tensor | None, AttentionMetadata | None]:
    """The scheduler puts a step's decodes first: those rows read the cache in place through the paged kernel (where
    it takes these heads), so only the prefill chunks after them need a packed varlen call. (decode rows, their
    output or None where there are none, the metadata of the sequences after them or None when every row was a
    decode); the count is made once a step for every layer."""
    decodes = meta.derived.get("decode_prefix")
    if decodes is None:
        decodes = meta.derived["decode_prefix"] = decode_prefix(meta) if paged_attention.usable(q) else 0
    if not decodes:
        return 0, None, meta
    head, rest = _paged_decode_rows(q, kv_cache, meta, scale, window, decodes)
    return decodes, head, rest


def _varlen_api() -> tuple[Callable[..., Any] | None, set[str]]:
    """Find torch's public varlen attention and the keyword arguments this torch version accepts.

    The signature moved between releases (2.10: ``is_causal``; 2.11: ``scale``; 2.12+: ``window_size``,
    ``enable_gqa``, ``seqused_k``, ``block_table``), so callers look at the parameter names.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, set()
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _flash_op_available() -> bool:
    return hasattr(torch.ops.aten, "_flash_attention_forward")


class FlashVarlenBackend:
    """CUDA backend on torch's built-in FlashAttention-2 varlen kernel.

    Every step, each sequence's whole KV (cached prefix + new tokens) is gathered from the paged
    cache into one packed tensor, then a single varlen call with a causal mask covers prefill,
    chunked prefill and decode in the same batch: FlashAttention aligns the causal mask to the
    bottom-right when seq_q < seq_k, which is exactly "query i sits at context + i". The gather
    costs an extra read+write of the KV per layer; a block-table kernel can replace it later
    without changing this interface. Inputs the kernel cannot take (float32, head_dim > 256) go
    to the sdpa backend, except leading decode rows the paged kernel takes (``_sdpa_forward``).

    Kernel entry point:
    * torch >= 2.12 (``varlen_attn`` has ``enable_gqa``): the public ``varlen_attn`` with
      ``window_size=(-1, 0)`` (causal) and ``enable_gqa=True``. ``enable_gqa`` is passed even for
      MHA because it keeps the wrapper on the FlashAttention kernel: its cuDNN branch is skipped
      when ``enable_gqa`` is set, and we have not verified that cuDNN's causal mask is bottom-right.
    * older torch (2.10/2.11 wrappers have no GQA and may route to cuDNN): the op those wrappers
      call, ``torch.ops.aten._flash_attention_forward``, which takes GQA natively.

    Sliding-window layers: ``window_size=(window - 1, 0)`` (the op: ``window_size_left/right``; a torch whose op
    has neither sends windowed layers to SDPA), over each sequence's keys from its first visible one, and decode
    rows' kernel reads only the window's blocks. Image spans: the rows inside one are recomputed after the call.
    """

    name = "flash"
    honours_kv_written = True

    def __init__(self) -> None:
        fn, params = _varlen_api()
        self._varlen = fn if fn is not None and "enable_gqa" in params and "window_size" in params else None
        if self._varlen is None and not _flash_op_available():
            raise RuntimeError("this torch has no FlashAttention varlen kernel")
        # Sliding windows: the public entry takes ``window_size``; the op, ``window_size_left/right`` where its
        # schema has them. Without either, windowed layers go to SDPA.
        self._windows = self._varlen is not None or _flash_op_has("window_size_left")
        self._fallback = SdpaBackend()

    @staticmethod
    def supports(q: Tensor) -> bool:
        return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256

    def forward(
        self, q: Tensor, k: Tensor | None, v: Tensor | None, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
        window: int = 0, bidirectional: bool = False,
    ) -> Tensor:
        if not self.supports(q) or (window > 0 and not self._windows):
            return self._sdpa_forward(q, k, v, kv_cache, meta, scale, window, bidirectional)
        if k is not None and v is not None:
            write_new_kv(k, v, kv_cache, meta)
        out = self._causal_forward(q, k, v, kv_cache, meta, scale, window)
        # The kernels' masks are causal (+ window); rows inside an image span also see the span's later keys.
        spans = meta.derived.get(f"spans:{bidirectional}")
        if spans is None:
            spans = meta.derived[f"spans:{bidirectional}"] = sequence_spans(meta, bidirectional)
        if any(spans):
            attend_span_rows(out, q, kv_cache, meta, scale, window, spans)
        return out

    def _sdpa_forward(
        self, q: Tensor, k: Tensor | None, v: Tensor | None, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
        window: int, bidirectional: bool,
    ) -> Tensor:
        """Heads the flash kernels cannot take (Gemma 4's 512-wide global heads; float32): SDPA, one call per sequence,
        except the step's leading decode rows where the paged kernel takes these heads (its start-up probe passed on
        their width): those read the cache in place in one launch, as on the other layers."""
        decodes = meta.derived.get("leading_decodes")
        if decodes is None:
            decodes = meta.derived["leading_decodes"] = decode_prefix(meta)
        if not decodes or not paged_attention.usable(q):
            return self._fallback.forward(q, k, v, kv_cache, meta, scale, window, bidirectional)
        if k is not None and v is not None:
            write_new_kv(k, v, kv_cache, meta)
        head, rest = _paged_decode_rows(q, kv_cache, meta, scale, window, decodes)
        if rest is None:
            return head
        # A decode row is never inside an image span with later keys; the chunks after it keep their spans.
        tail = self._fallback.forward(q[decodes:], None, None, kv_cache, rest, scale, window, bidirectional)
        return torch.cat([head, tail])

    def _causal_forward(
        self, q: Tensor, k: Tensor | None, v: Tensor | None, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
        window: int,
    ) -> Tensor:
        decodes, head, rest = leading_decodes(q, kv_cache, meta, scale, window)
        if rest is None:
            assert head is not None
            return head
        k_rest, v_rest = (None, None) if k is None or v is None else (k[decodes:], v[decodes:])
        chunks = self._varlen_forward(q[decodes:], k_rest, v_rest, kv_cache, rest, scale, window)
        return torch.cat([head, chunks]) if head is not None else chunks

    def _varlen_forward(
        self, q: Tensor, k: Tensor | None, v: Tensor | None, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
        window: int,
    ) -> Tensor:
        max_k = meta.max_seq_len
        no_prefix = meta.derived.setdefault("no_prefix", meta.query_lens_cpu == meta.seq_lens_cpu)
        if no_prefix and k is not None and v is not None and not kv_quant.is_fp8(kv_cache):
            # Every sequence starts in this step (fresh prompts, first chunks): its whole KV is k, v.
            k_all, v_all, cu_seq_k = k.contiguous(), v.contiguous(), meta.query_start_loc
        elif window > 0:  # from each sequence's first visible key only: the kernel aligns its window bottom-right
            k_all, v_all, cu_seq_k, max_k = self._gather_window_kv(kv_cache, meta, window, q.dtype)
        else:
            k_all, v_all, cu_seq_k = self.gather_packed_kv(kv_cache, meta, q.dtype)
        # Both entry points take the packed q, k, v, their cu_seqlens and maximum lengths first.
        args = (q.contiguous(), k_all, v_all, meta.query_start_loc, cu_seq_k, meta.max_query_len, max_k)
        # FlashAttention's window (left, right) keeps keys [i - left, i + right] of the query at (aligned) position
        # i; ours keeps i - window < j <= i, so left = window - 1.
        left = window - 1 if window > 0 else -1
        if self._varlen is not None:
            result: Tensor = self._varlen(*args, scale=scale, window_size=(left, 0), enable_gqa=True)
            return result
        if window > 0:  # dropout_p 0, not causal (the window's right edge 0 is), no debug mask
            windowed: Tensor = torch.ops.aten._flash_attention_forward(
                *args, 0.0, False, False, scale=scale, window_size_left=left, window_size_right=0
            )[0]
            return windowed
        # dropout_p 0, is_causal, no debug mask
        out: Tensor = torch.ops.aten._flash_attention_forward(*args, 0.0, True, False, scale=scale)[0]
        return out

    @staticmethod
    def gather_packed_kv(
        kv_cache: Tensor, meta: AttentionMetadata, dtype: torch.dtype | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Packed [sum(seq_lens), Hkv, D] K and V plus their int32 cu_seqlens, built without host syncs.

        The slot of every packed row depends only on the metadata, so it is computed once per forward.
        """
        cached = meta.derived.get("flash_packed_kv")
        if cached is None:
            cached = meta.derived["flash_packed_kv"] = packed_kv_slots(meta, kv_cache.shape[2])
        slot, cu = cached
        flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
        return *_read_slots(flat, slot, kv_cache, dtype), cu

    @staticmethod
    def _gather_window_kv(
        kv_cache: Tensor, meta: AttentionMetadata, window: int, dtype: torch.dtype | None = None
    ) -> tuple[Tensor, Tensor, Tensor, int]:
        """``gather_packed_kv`` for a sliding layer: each sequence's keys from its first visible one, so a long
        context costs a window's worth of copying, not the whole sequence. Slots computed once per forward."""
        cached = meta.derived.get(f"flash_window_kv:{window}")
        if cached is None:
            cached = meta.derived[f"flash_window_kv:{window}"] = windowed_packed_kv_slots(meta, kv_cache.shape[2], window)
        slot, cu, max_k = cached
        flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
        return *_read_slots(flat, slot, kv_cache, dtype), cu, max_k


def _read_slots(flat: Tensor, slot: Tensor, kv_cache: Tensor, dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """K and V at ``slot`` of the cache viewed as ``flat`` [2, slots, Hkv, D]; an FP8 cache's dequantized to
    ``dtype``, the queries' (the kernel cannot take e4m3 keys beside half-precision queries)."""
    if not kv_quant.is_fp8(kv_cache):
        return flat[0, slot], flat[1, slot]
    if dtype is None:
        raise ValueError("reading an FP8 cache needs the queries' dtype")
    kv_quant.note_path("flash", "over dequantized gathers of the cache (prefill chunks)")
    return kv_quant.dequantize_pair(flat[0, slot], flat[1, slot], kv_cache, dtype)


class PaddedDecodeBackend:
    """Decode-only attention whose shapes depend only on (batch, block-table width): for CUDA graphs.

    Every sequence has exactly one new token. Its keys are read through the whole padded block table
    (``[B, W]`` blocks -> ``[B, W * block_size]`` keys) and only the first ``seq_len`` of them count, so
    no shape follows the sequences' lengths and nothing is read back to the host.

    On CUDA (fp16/bf16) this is FlashAttention varlen with fixed ``cu_seqlens_k`` over the padded rows
    and the real lengths in ``seqused_k``: with one query per sequence and no causal flag it takes its
    split-KV decode kernel, so a single long sequence still spreads over the SMs (a masked SDPA on the
    fused mem-efficient kernel runs one block per (sequence, KV head): 1.4 ms per layer at 21k tokens,
    measured). Elsewhere: SDPA with a length mask, GQA folded into the query length (the G query heads
    sharing a KV head become G query rows of that head).

    A sliding-window layer passes its ``window`` as a Python constant, so a captured graph holds it: the Triton
    kernel reads only the window's blocks, FlashAttention gets ``window_size_left`` (its window follows
    ``seqused_k``), and the SDPA mask hides the keys before the window. ``bidirectional`` changes nothing here:
    a decode row is never inside an image span with later keys. ``k = v = None``: nothing is written.
    """

    name = "padded_decode"
    honours_kv_written = True

    def forward(
        self, q: Tensor, k: Tensor | None, v: Tensor | None, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
        window: int = 0, bidirectional: bool = False,
    ) -> Tensor:
        if k is not None and v is not None:
            write_new_kv(k, v, kv_cache, meta)
        if paged_attention.usable(q):  # in place: no padded copy of the keys (see paged_attention)
            width = meta.block_tables.shape[1] * kv_cache.shape[2]
            split = meta.derived.get("split_tokens")
            return paged_attention.paged_decode(
                q, kv_cache, meta.block_tables, meta.seq_lens, scale, width, split, window
            )
        b, hq, d = q.shape
        hkv = kv_cache.shape[-2]
        kv = kv_cache[:, meta.block_tables].flatten(2, 3)  # [2, B, L = W * block_size, Hkv, D]
        if kv_quant.is_fp8(kv_cache):  # the kernels below take no e4m3: the padded gather is dequantized
            kv_quant.note_path(self.name, "over a dequantized padded gather of the cache")
            kv = kv_quant.dequantize_kv(kv, kv_cache, q.dtype)
        width = kv.shape[2]
        windowed = 0 < window < width
        flash = _flash_seqused_available() and FlashVarlenBackend.supports(q)
        if flash and (not windowed or _flash_op_has("window_size_left")):
            lens = meta.derived.get("decode_lens")
            if lens is None:  # same for all layers
                step = torch.arange(b + 1, dtype=torch.int32, device=q.device) * width
                lens = meta.derived["decode_lens"] = (step, meta.seq_lens.int())
            extra = {"window_size_left": window - 1, "window_size_right": 0} if windowed else {}
            out: Tensor = torch.ops.aten._flash_attention_forward(
                q, kv[0].flatten(0, 1), kv[1].flatten(0, 1), meta.query_start_loc, lens[0], 1, width,
                0.0, False, False, scale=scale, seqused_k=lens[1], **extra,
            )[0]
            return out
        key = f"decode_mask:{window if windowed else 0}"
        mask = meta.derived.get(key)
        if mask is None:  # same for all layers of this window
            keys = torch.arange(width, device=q.device)
            lens = meta.seq_lens[:, None]
            visible = (keys < lens) & (keys >= lens - window) if windowed else keys < lens
            mask = meta.derived[key] = visible.view(b, 1, 1, -1)
        args = (q.view(b, hkv, hq // hkv, d), kv[0].transpose(1, 2), kv[1].transpose(1, 2))
        if q.is_cuda:  # no cuDNN: its masked path is not needed here and we capture this in graphs
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                out = F.scaled_dot_product_attention(*args, attn_mask=mask, scale=scale)
        else:
            out = F.scaled_dot_product_attention(*args, attn_mask=mask, scale=scale)
        return out.reshape(b, hq, d)


@functools.cache
def _flash_op_has(argument: str) -> bool:
    """torch's FlashAttention op takes the keyword ``argument`` (the schema grew between releases)."""
    if not _flash_op_available():
        return False
    schema = torch.ops.aten._flash_attention_forward.default._schema
    return any(arg.name == argument for arg in schema.arguments)


def _flash_seqused_available() -> bool:
    """torch's FlashAttention op takes per-sequence used key counts (``seqused_k``)."""
    return _flash_op_has("seqused_k")


def flash_available() -> bool:
    """True when this torch has a FlashAttention varlen entry point (CUDA is checked separately)."""
    fn, params = _varlen_api()
    return (fn is not None and "enable_gqa" in params and "window_size" in params) or _flash_op_available()
