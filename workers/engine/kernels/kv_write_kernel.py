"""The new tokens' K and V into their cache slots: ``write_kv_cache``, one Triton kernel on CUDA.

The attention backends scattered K and V with two ``index_copy_`` calls per layer: 56 kernels of ~2.2 us
each in a 7B's decode step, about 3% of a batch-1 step on an H200 (session 13's profile), plus a launch gap
after each inside the CUDA graph. Here one program copies one token's K row and V row (kv_heads x head_dim each),
so a layer writes its cache in one launch. It is a plain copy: the cache holds exactly the bits index_copy_ would
have written.

The token count and the slot values are runtime arguments (nothing specialises on them), so the variant the
start-up warm-up compiles is the one every step and every CUDA-graph capture uses.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels import kv_quant, pdl
from workers.engine.kernels.triton_switch import TritonSwitch

SWITCH = TritonSwitch("GLIMPSE_TRITON_KV_WRITE")
available = SWITCH.on


def usable(k: Tensor, v: Tensor, kv_cache: Tensor) -> bool:
    """CUDA (or the interpreter's CPU tensors, for tests), the cache's dtype, and rows whose heads are packed:
    [T, Hkv, D] with unit stride along D and D along Hkv (a row may sit inside a wider qkv row)."""
    row_ok = all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (k, v))
    return row_ok and k.dtype == v.dtype == kv_cache.dtype and kv_cache.is_contiguous() and available()


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["plane"])
    def kv_write_kernel(
        k_ptr, v_ptr, cache_ptr, slot_ptr, k_stride, v_stride, plane,
        ROW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # pdl.py: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < ROW
        dst = cache_ptr + slot * ROW + cols
        tl.store(dst, tl.load(k_ptr + t * k_stride + cols, mask=mask), mask=mask)
        tl.store(dst + plane, tl.load(v_ptr + t * v_stride + cols, mask=mask), mask=mask)

    return kv_write_kernel


def write_kv_cache(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter the new tokens' K/V into their slots (cache viewed as [2, num_slots, Hkv, D]). An FP8 cache gets them
    quantized with its per-head scales, then copied as bytes (neither index_copy_ on the CPU nor every GPU's Triton
    takes e4m3 itself; a copy of bytes is the same copy)."""
    if kv_quant.is_fp8(kv_cache):
        scales = kv_quant.scales_of(kv_cache)
        k, v = kv_quant.quantize(k, scales[0]).view(torch.uint8), kv_quant.quantize(v, scales[1]).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    elif k.dtype != kv_cache.dtype:  # a same-dtype .to() is free on the GPU but not on the CPU that launches it
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if k.is_cuda and usable(k, v, kv_cache):  # both in one launch
        write(k, v, kv_cache, slot_mapping)
        return
    slots = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    slots[0].index_copy_(0, slot_mapping, k)
    slots[1].index_copy_(0, slot_mapping, v)


def write(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """k, v [T, Hkv, D] into ``kv_cache`` ([2, ...slots..., Hkv, D]) at ``slot_mapping`` (int64 [T])."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    row = k.shape[-2] * k.shape[-1]
    plane = kv_cache[0].numel()  # elements from a K slot to its V slot
    block = max(128, 1 << (row - 1).bit_length())
    _kernel()[(tokens,)](
        k, v, kv_cache, slot_mapping, k.stride(0), v.stride(0), plane, ROW=row, BLOCK=block, num_warps=4,
        **pdl.launch(k.device),
    )


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Write a few rows (V a strided view, as the qkv split gives it) and compare with index_copy_; a Triton that
    cannot compile here or a wrong copy turns the kernel off for the process (index_copy_ serves)."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 3, 2, 64, generator=gen).to(device=device, dtype=dtype)
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([7, 0, 12, 3, 9], dtype=torch.int64, device=device)
    got = torch.zeros(2, 4, 4, 2, 64, dtype=dtype, device=device)
    want = got.clone()
    flat = want.view(2, -1, 2, 64)
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)

    def check() -> bool:
        write(k, v, got, slots)
        return torch.equal(got, want)

    return SWITCH.probe(check)
