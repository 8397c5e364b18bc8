"""Steps for the sliding-window and in-image bidirectional attention tests: a paged cache holding each sequence's
cached prefix, the new tokens' q/k/v, the metadata with its image spans, and a dense reference whose mask is built by
transformers' own Gemma 4 mask functions on explicit positions."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers.masking_utils import (
    and_masks,
    blockwise_overlay,
    causal_mask_function,
    or_masks,
    sliding_window_overlay,
)
from transformers.models.gemma4.modeling_gemma4 import get_block_sequence_ids_for_mask

from workers.engine.kernels.attention import AttentionMetadata, build_attention_metadata
from workers.engine.kernels.torch_attention import FlashVarlenBackend, SdpaBackend

Span = tuple[int, int]


@dataclass(frozen=True)
class Seq:
    """One sequence of a step: ``context`` cached tokens, ``new`` tokens this step, its images' [start, end)."""

    context: int
    new: int
    spans: tuple[Span, ...] = ()


@dataclass
class Step:
    cache: Tensor  # [2, blocks, block_size, Hkv, D], the cached prefixes written
    meta: AttentionMetadata
    q: Tensor  # [T, Hq, D]
    k: Tensor  # [T, Hkv, D], the new tokens'
    v: Tensor
    full_k: list[Tensor]  # every sequence's whole K (context + new), float32 on CPU
    full_v: list[Tensor]
    seqs: list[Seq]


def make_step(
    seqs: Sequence[Seq], hq: int = 6, hkv: int = 2, d: int = 16, block_size: int = 4, seed: int = 0,
    dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> Step:
    """A random step: each sequence's blocks scattered over the cache (block 0 never used: it pads the tables)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(s.context + s.new) // block_size) for s in seqs]
    free = list(range(1, sum(need) + 4))
    random.Random(seed).shuffle(free)
    cache = torch.randn(2, sum(need) + 4, block_size, hkv, d, generator=gen)
    tables, full_k, full_v = [], [], []
    for s, n in zip(seqs, need, strict=True):
        table = [free.pop() for _ in range(n)]
        k, v = torch.randn(2, s.context + s.new, hkv, d, generator=gen)
        for pos in range(s.context):
            cache[:, table[pos // block_size], pos % block_size] = torch.stack([k[pos], v[pos]])
        tables.append(table)
        full_k.append(k)
        full_v.append(v)
    meta = build_attention_metadata(
        [s.new for s in seqs], [s.context + s.new for s in seqs], tables, block_size, device=device
    )
    meta.bidir_spans = [list(s.spans) for s in seqs]
    q = torch.randn(sum(s.new for s in seqs), hq, d, generator=gen)
    new_k = torch.cat([k[s.context :] for k, s in zip(full_k, seqs, strict=True)])
    new_v = torch.cat([v[s.context :] for v, s in zip(full_v, seqs, strict=True)])
    return Step(
        cache.to(device, dtype), meta, q.to(device, dtype), new_k.to(device, dtype), new_v.to(device, dtype),
        full_k, full_v, list(seqs),
    )


def transformers_mask(seq: Seq, window: int, bidirectional: bool) -> Tensor:
    """Boolean [new, context + new]: Gemma 4's sliding-layer mask (AND(window, OR(causal, same image))) from
    transformers' mask functions, the images' block ids from its ``get_block_sequence_ids_for_mask``."""
    seq_len = seq.context + seq.new
    # transformers types these functions on ints; it evaluates them on broadcast index tensors as here
    mask_fn: Callable[..., Any] = causal_mask_function
    if bidirectional:
        types = torch.zeros(1, seq_len, dtype=torch.long)
        for start, end in seq.spans:
            types[0, start:end] = 1
        block_ids = get_block_sequence_ids_for_mask(types, torch.device("cpu"))
        mask_fn = or_masks(causal_mask_function, blockwise_overlay(block_ids))
    if window:
        mask_fn = and_masks(sliding_window_overlay(window), mask_fn)
    q_idx = torch.arange(seq.context, seq_len)[:, None]
    kv_idx = torch.arange(seq_len)[None, :]
    mask: Tensor = mask_fn(torch.zeros((), dtype=torch.long), None, q_idx, kv_idx)
    return mask.expand(seq.new, seq_len)


def reference(step: Step, scale: float, window: int = 0, bidirectional: bool = False) -> Tensor:
    """Every new row of the step by an explicit masked softmax in float64, on CPU, returned as float32."""
    outs, start = [], 0
    for seq, k, v in zip(step.seqs, step.full_k, step.full_v, strict=True):
        q = step.q[start : start + seq.new].double().cpu()
        group = q.shape[1] // k.shape[1]
        keys, values = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        scores = scores.masked_fill(~transformers_mask(seq, window, bidirectional), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).float())
        start += seq.new
    return torch.cat(outs)


def reference_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int, max_k: int, *,
    scale: float, window_size: tuple[int, int], enable_gqa: bool,
) -> Tensor:
    """torch's ``varlen_attn`` as documented (FlashAttention-2's contract), in float32: segment b's rows are
    ``cu_seq_q[b]:cu_seq_q[b+1]`` and its keys ``cu_seq_k[b]:cu_seq_k[b+1]``; with the rows aligned to the last keys
    (row r at key position r + sk - sq), window (left, right) keeps keys [r' - left, r' + right], -1 meaning
    unbounded."""
    assert enable_gqa and cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
    left, right = window_size
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bq, bk = cu_seq_q.tolist(), cu_seq_k.tolist()
    for b in range(len(bq) - 1):
        sq, sk = bq[b + 1] - bq[b], bk[b + 1] - bk[b]
        assert sq <= max_q and sk <= max_k
        aligned = torch.arange(sq)[:, None] + (sk - sq)
        keys = torch.arange(sk)[None, :]
        allowed = torch.ones(sq, sk, dtype=torch.bool)
        if left >= 0:
            allowed &= keys >= aligned - left
        if right >= 0:
            allowed &= keys <= aligned + right
        kb, vb = (t[bk[b] : bk[b + 1]].float().repeat_interleave(group, 1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[bq[b] : bq[b + 1]].float(), kb) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[bq[b] : bq[b + 1]] = torch.einsum("hqk,khd->qhd", probs, vb).to(q.dtype)
    return out


def cpu_flash_backend() -> FlashVarlenBackend:
    """A FlashVarlenBackend that takes CPU float32 steps, with ``reference_varlen`` standing in for the kernel: the
    backend's own work (decode rows, packed or windowed gathers, window arguments, span rows) is what runs."""
    backend = FlashVarlenBackend.__new__(FlashVarlenBackend)
    backend._varlen, backend._windows, backend._fallback = reference_varlen, True, SdpaBackend()
    backend.supports = lambda q: True  # type: ignore[method-assign]
    return backend
