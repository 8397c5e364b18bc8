"""Decode attention that reads the paged KV cache in place (Triton), for sequences with one new token each.

Before this kernel, a decode gathered every sequence's keys and values out of their blocks into a packed
copy per layer and then ran FlashAttention over the copy. Under load that copy dominated the step: 64
sequences of ~2.9k tokens padded to 4,096 moved ~1.6 GB per layer (gather read + write, then the kernel's
read), 26.6 ms per decode step on an H100 where the weights and the live KV need ~8 ms (docs/perf-notes.md,
session 9). Here each program walks one sequence's block table itself and loads K/V tiles straight from
the cache.

Split-KV ("flash decoding"): the grid is (sequence, KV head, split). A program takes the query heads that
share its KV head (GQA: 7 for Qwen2.5-VL-7B, padded to 16 rows for ``tl.dot``), walks its split's slice of
the keys in tiles of ``TILE`` tokens with an online softmax, and writes an unnormalised partial output and
its log-sum-exp. A second kernel combines the splits that saw keys. Splits are chosen from the padded width, not
the real lengths, so the grid is fixed for a CUDA-graph bucket; a split past a sequence's end costs one length load.

Sliding-window layers (``window``): each sequence's splits start at its window's first key, so only the window's
blocks are read, and the grid is planned over the window, not the table width. A ``WINDOWED`` constexpr keeps the
full-attention kernel's code as it was.

The same code runs under ``TRITON_INTERPRET=1`` on the CPU, which is how CI checks it against the gather
path (tests/workers/engine/kernels/test_paged_attention.py).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels import kv_quant, pdl

log = logging.getLogger(__name__)

TILE = 64  # keys per inner step: four 16-token blocks, [64, 128] bf16 = 16 KB per K or V tile
# Heads wider than 256 (Gemma 4's global layers: 512) walk half the keys per step with twice the warps, so a K or V
# tile stays 32 KB and two pipeline stages of both fit in a Hopper SM's shared memory. Each such width is taken only
# after the start-up probe passed on it (``probe``): its register and shared-memory budget is the card's to refuse.
WIDE_HEAD_DIM, MAX_HEAD_DIM, WIDE_TILE, WIDE_WARPS = 256, 512, 32, 8
_TARGET_PROGRAMS = 2  # programs per SM the split count aims for
_WARPS, _STAGES = 4, 2  # the split kernel's launch (benchmarks/kernels/paged_decode_bench.py --sweep)
# A grid of few programs (under _FEW_PROGRAMS per SM) whose splits walk many tiles is latency-bound: such a plan gets
# splits of at most _MAX_TILES_PER_SPLIT tiles. On an H200 that took 8-32 sequences of 20k keys 1.2-1.4x faster, and
# left 2.9k-key batches alone; cutting a grid that already has ~4 programs per SM (128 x 2.9k keys) lost 6%
# (benchmarks/kernels/paged_decode_bench.py --splits, docs/benchmarks.md session 18).
_FEW_PROGRAMS, _MAX_TILES_PER_SPLIT = 3, 32
# At most this many splits: the plan's cap (a split count is an integer argument the kernels do not specialise on).
MAX_SPLITS = 64
# The combine kernel reads the splits' partial outputs this many at a time (one compiled shape for every split count).
COMBINE_CHUNK = 16


_broken: list[str] = []  # set by probe(): why the kernel is off in this process
_wide_checked: set[int] = set()  # head dims over WIDE_HEAD_DIM whose probe passed on this process's card


@functools.cache
def triton_available() -> bool:
    """Triton imports and the kernels may run here (CUDA, or the interpreter when TRITON_INTERPRET=1)."""
    if os.environ.get("GLIMPSE_PAGED_ATTENTION", "1") == "0" or _broken:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def probe(
    device: torch.device, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
    sliding: bool = False, kv_dtype: torch.dtype | None = None,
) -> bool:
    """Run the kernel once on this model's head shapes against a gather + softmax reference. A Triton that
    cannot compile here (no C compiler for its launcher, an unsupported card) or a wrong answer switches the
    kernel off for the process, and decode falls back to the gather path, rather than failing mid-serving.
    ``sliding``: these heads serve sliding-window layers, so the windowed variant is compiled and checked too.
    ``kv_dtype`` FP8: the cache is e4m3 with per-head scales, so the FP8 variant is the one checked (a card whose
    Triton cannot convert e4m3 decodes through the dequantizing gather path)."""
    q = torch.zeros(1, num_q_heads, head_dim, dtype=dtype, device=device)
    wide = WIDE_HEAD_DIM < head_dim <= MAX_HEAD_DIM
    if wide and triton_available() and (dtype in (torch.float16, torch.bfloat16) or not q.is_cuda):
        _wide_checked.add(head_dim)  # on trial: a failure below takes it back without switching the kernel off
    if not usable(q):
        return False
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        cache = torch.randn(2, 5, 16, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        if kv_dtype == kv_quant.FP8:
            scales = torch.linspace(0.5, 2.0, 2 * num_kv_heads, device=device).view(2, num_kv_heads)
            values = cache
            cache = torch.stack([kv_quant.quantize(values[i], scales[i]) for i in (0, 1)])
            kv_quant.attach_scales(cache, scales)
        q = torch.randn(2, num_q_heads, head_dim, generator=gen, device=device).to(dtype)
        tables = torch.tensor([[3, 1, 4], [0, 2, 4]], dtype=torch.int32, device=device)
        lens = [37, 20]
        group = num_q_heads // num_kv_heads
        for window in (0, 24) if sliding else (0,):
            out = paged_decode(
                q, cache, tables, torch.tensor(lens, dtype=torch.int32, device=device), 0.125, 48, window=window
            )
            for b, n in enumerate(lens):
                slots = [int(tables[b, p // 16]) * 16 + p % 16 for p in range(max(0, n - window) if window else 0, n)]
                kv = kv_quant.dequantize_kv(cache.view(2, -1, num_kv_heads, head_dim)[:, slots], cache, torch.float32)
                k, v = (kv[i].repeat_interleave(group, 1) for i in (0, 1))
                scores = torch.einsum("hd,khd->hk", q[b].float(), k) * 0.125
                ref = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
                if not torch.allclose(out[b].float(), ref, atol=3e-2, rtol=3e-2):
                    raise RuntimeError(f"wrong result (max error {(out[b].float() - ref).abs().max().item():.3g})")
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
        if wide:  # the narrower heads keep the kernel; only this width decodes through the gather path
            _wide_checked.discard(head_dim)
            log.warning("Triton paged decode attention unavailable for head_dim %d (gather path): %s", head_dim, exc)
            return False
        _broken.append(str(exc))
        triton_available.cache_clear()
        log.warning("Triton paged decode attention unavailable, decoding through the gather path: %s", exc)
        return False
    return True


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def usable(q: Tensor) -> bool:
    """Whether ``paged_decode`` can take this query: CUDA half types (or the CPU interpreter in tests)."""
    if not triton_available():
        return False
    d = q.shape[-1]
    if q.is_cuda:
        return q.dtype in (torch.float16, torch.bfloat16) and (d <= WIDE_HEAD_DIM or d in _wide_checked)
    return interpreted() and d <= MAX_HEAD_DIM


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["stride_tb", "num_splits", "tokens_per_split", "window"])
    def split_kernel(
        q_ptr, kv_ptr, table_ptr, lens_ptr, part_out_ptr, part_lse_ptr, split_ptr, k_scale_ptr, v_scale_ptr,
        scale, stride_qb, stride_qh, stride_side, stride_slot, stride_head, stride_tb,
        num_q_heads, num_splits, tokens_per_split, window,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLIT_FROM_PTR: tl.constexpr, WINDOWED: tl.constexpr,
        FP8: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # pdl.py: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b)
        if SPLIT_FROM_PTR:  # a CUDA graph's input, set per replay
            # Never shorter than this grid needs to cover the sequence: the input is planned from one KV head
            # count, and a model with caches of several shapes (Gemma 4) has layers of another.
            tokens_per_split = tl.maximum(tl.load(split_ptr), tl.cdiv(seq_len, num_splits))
        start = split * tokens_per_split
        if WINDOWED:  # the splits cover the window's keys only: its first block is the first one read
            start += tl.maximum(seq_len - window, 0)
        end = tl.minimum(seq_len, start + tokens_per_split)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, D_P)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        dmask = d < D
        # A split past the sequence's end (most of a graph bucket's grid while the contexts are short) reads
        # nothing and writes only its log-sum-exp, -inf; the combine reads the live splits only.
        live = start < end
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None] & dmask[None, :] & live, other=0.0,
        )
        if FP8:  # this program's KV head's scales: e4m3 tiles are widened, scaled and rounded to q's dtype
            k_scale = tl.load(k_scale_ptr + kvh)
            v_scale = tl.load(v_scale_ptr + kvh)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, D_P], tl.float32)
        for t0 in range(start, end, TILE):
            t = t0 + tl.arange(0, TILE)
            tmask = t < end
            block = tl.load(table_ptr + b * stride_tb + t // BLOCK_SIZE, mask=tmask, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + t % BLOCK_SIZE
            offs = slot[:, None] * stride_slot + kvh * stride_head + d[None, :]
            kv_mask = tmask[:, None] & dmask[None, :]
            k = tl.load(kv_ptr + offs, mask=kv_mask, other=0.0)
            v = tl.load(kv_ptr + stride_side + offs, mask=kv_mask, other=0.0)
            if FP8:
                k = (k.to(tl.float32) * k_scale).to(q.dtype)
                v = (v.to(tl.float32) * v_scale).to(q.dtype)
            qk = tl.dot(q, tl.trans(k)) * scale
            qk = tl.where(tmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        row = (b * num_q_heads + heads) * num_splits + split
        lse = tl.where(l_sum > 0, m + tl.log(tl.where(l_sum > 0, l_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=gmask)
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(part_out_ptr + row[:, None] * D_P + d[None, :], out, mask=gmask[:, None] & live)

    @triton.jit(do_not_specialize=["num_splits", "tokens_per_split", "window"])
    def combine_kernel(
        part_out_ptr, part_lse_ptr, out_ptr, lens_ptr, split_ptr, stride_ob, stride_oh, num_q_heads, num_splits,
        tokens_per_split, window,
        D: tl.constexpr, D_P: tl.constexpr, CHUNK: tl.constexpr, SPLIT_FROM_PTR: tl.constexpr,
        WINDOWED: tl.constexpr, COUNT_LIVE: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # pdl.py: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        b = tl.program_id(0)
        h = tl.program_id(1)
        live_splits = num_splits
        if COUNT_LIVE:
            # A grid of more splits than one chunk (a CUDA-graph bucket is planned for its full table width: 64
            # splits at batch 1 and 32k tokens) reads only the splits that saw keys, the first cdiv(keys, split
            # length) as the split kernel computes them: a decode over a few hundred keys has them all in its first
            # chunk, and each chunk is a dependent round trip to memory, most of this kernel's time at batch 1.
            seq_len = tl.load(lens_ptr + b)
            if SPLIT_FROM_PTR:
                tokens_per_split = tl.maximum(tl.load(split_ptr), tl.cdiv(seq_len, num_splits))
            keys = seq_len
            if WINDOWED:
                keys = tl.minimum(seq_len, window)
            live_splits = tl.minimum(num_splits, tl.cdiv(keys, tokens_per_split))
        s = tl.arange(0, CHUNK)
        d = tl.arange(0, D_P)
        first = (b * num_q_heads + h) * num_splits
        # One pass, CHUNK splits at a time (a [64, D_P] float32 tile would be 128 values a thread at 4 warps for
        # 256-wide heads), the running sums rescaled to the largest log-sum-exp so far. Counted live splits all
        # wrote an output (each saw a key), so it loads beside their log-sum-exps; otherwise a split's output is
        # read only where its log-sum-exp says it saw keys. With at most CHUNK splits read, most steps, this is
        # the two-pass sum exactly: one chunk, scaled by its own maximum.
        top = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), 0)
        total = tl.sum(tl.zeros([CHUNK], tl.float32), 0)
        acc = tl.zeros([D_P], tl.float32)
        for s0 in range(0, live_splits, CHUNK):
            smask = s0 + s < live_splits
            lse = tl.load(part_lse_ptr + first + s0 + s, mask=smask, other=float("-inf"))
            wrote = smask if COUNT_LIVE else smask & (lse > float("-inf"))
            parts = tl.load(part_out_ptr + (first + s0 + s)[:, None] * D_P + d[None, :], mask=wrote[:, None], other=0.0)
            new_top = tl.maximum(top, tl.max(lse, 0))
            ref = tl.where(new_top == float("-inf"), 0.0, new_top)  # -inf only where no split saw a key
            rescale = tl.exp(top - ref)
            w = tl.exp(lse - ref)
            total = total * rescale + tl.sum(w, 0)
            acc = acc * rescale + tl.sum(parts * w[:, None], 0)
            top = new_top
        out = acc / tl.where(total > 0, total, 1.0)  # no key at all (a padding row): zeros
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)

    return split_kernel, combine_kernel


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_splits(batch: int, max_tokens: int, num_kv_heads: int, device: torch.device) -> tuple[int, int]:
    """(splits, tokens per split) for ``batch`` sequences of at most ``max_tokens`` keys: enough programs
    to fill the GPU twice over, short splits where the programs are few, never a split shorter than one tile.
    Depends only on its arguments, so a CUDA-graph bucket (fixed batch and padded width) always gets the same grid."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 4
    tiles = max(1, -(-max_tokens // TILE))
    want = -(-_TARGET_PROGRAMS * sms // max(1, batch * num_kv_heads))
    splits = max(1, min(tiles, want, MAX_SPLITS))
    if batch * num_kv_heads * splits < _FEW_PROGRAMS * sms:
        splits = max(splits, min(tiles, MAX_SPLITS, -(-tiles // _MAX_TILES_PER_SPLIT)))
    per_split = -(-tiles // splits) * TILE
    return -(-max_tokens // per_split) if max_tokens else 1, per_split


def paged_decode(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    max_tokens: int,
    split_tokens: Tensor | None = None,
    window: int = 0,
) -> Tensor:
    """Attention of one query per sequence over its cached keys, read through its block table.

    q [B, Hq, D]; kv_cache [2, num_blocks, block_size, Hkv, D] (this step's K/V already written);
    block_tables int32 [B, W]; seq_lens int32 [B] (keys per sequence, the new token's included);
    ``max_tokens`` >= every seq_len (e.g. W * block_size), which fixes the grid. ``split_tokens``: a
    one-element device tensor with the keys per split to use instead of the plan's (CUDA graphs: the plan
    for the step's real width, never more splits than the grid has). ``window`` > 0 (a sliding-window layer): the
    query sees only its sequence's last ``window`` keys, and the grid is planned over those (``split_tokens`` is
    then unused: the plan for ``min(max_tokens, window)`` keys depends only on constants of a CUDA-graph bucket).
    Returns [B, Hq, D].
    """
    split_kernel, combine_kernel = _kernels()
    b, hq, d = q.shape
    _, _, block_size, hkv, _ = kv_cache.shape
    windowed = 0 < window < max_tokens  # a window as long as every sequence cuts nothing
    if windowed:
        split_tokens = None
    splits, per_split = plan_splits(b, window if windowed else max_tokens, hkv, q.device)
    group = hq // hkv
    d_p = 1 << (d - 1).bit_length()
    wide = d_p > WIDE_HEAD_DIM
    q = q.contiguous()
    part_out = torch.empty((b, hq, splits, d_p), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    flat = kv_cache.view(2, -1, hkv, d)  # [2, slots, Hkv, D]
    fp8 = kv_quant.is_fp8(kv_cache)
    if fp8:
        kv_quant.note_path("Triton paged decode", "reads e4m3 in place")
    scales = kv_quant.scales_of(kv_cache) if fp8 else None
    k_scales, v_scales = (scales[0], scales[1]) if scales is not None else (seq_lens, seq_lens)  # unread when not FP8
    launch = pdl.launch(q.device)
    split_kernel[(b, hkv, splits)](
        q, flat, block_tables, seq_lens, part_out, part_lse, seq_lens if split_tokens is None else split_tokens,
        k_scales, v_scales,
        scale, q.stride(0), q.stride(1), flat.stride(0), flat.stride(1), flat.stride(2), block_tables.stride(0),
        hq, splits, per_split, window,
        GROUP=group, GROUP_P=max(16, 1 << (group - 1).bit_length()), D=d, D_P=d_p,
        BLOCK_SIZE=block_size, TILE=WIDE_TILE if wide else TILE, SPLIT_FROM_PTR=split_tokens is not None,
        WINDOWED=windowed, FP8=fp8, num_warps=WIDE_WARPS if wide else _WARPS,
        num_stages=_STAGES, **launch,
    )  # fmt: skip
    combine_kernel[(b, hq)](
        part_out, part_lse, out, seq_lens, seq_lens if split_tokens is None else split_tokens,
        out.stride(0), out.stride(1), hq, splits, per_split, window,
        D=d, D_P=d_p, CHUNK=COMBINE_CHUNK, SPLIT_FROM_PTR=split_tokens is not None, WINDOWED=windowed,
        COUNT_LIVE=splits > COMBINE_CHUNK, num_warps=WIDE_WARPS if wide else 4, **launch,
    )  # fmt: skip
    return out
