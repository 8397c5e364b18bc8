"""FP8 KV cache (``--kv-cache-dtype fp8``): the cache dtype, its scales, and the quantize / dequantize every backend
shares.

A cache in FP8 holds e4m3 values ``x / scale`` (saturated at +-448, e4m3's largest finite value: torch's cast does
not saturate, an out-of-range value would become NaN), one scale per KV head for K and one for V. A per-tensor scale
is the same value in every head. Readers multiply back by the scale: ``dequantize``. Values are written once, when
the step's new K/V go into their slots (kv_write_kernel.write_kv_cache), and every read sees those stored values,
including the step's own new tokens, so the first prefill, later chunks and decode all attend over the same numbers.

The scales ride on the cache tensor (``attach_scales`` / ``scales_of``) rather than through the backend protocol:
every consumer of a layer's cache (the backends, the CUDA-graph pieces, Gemma 4's KV-shared layers reading their
store layer's cache) is handed that cache object and nothing else, so the cache's own scales are always the ones
its contents were written with. A view of the cache loses them, and ``scales_of`` refuses an FP8 cache without
scales rather than guessing 1.0.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from workers.engine.kernels.fp8_quant import FP8, FP8_MAX

log = logging.getLogger("glimpse.model")

_SCALES = "glimpse_kv_scales"
_logged: set[tuple[str, str]] = set()


def dtype_name(dtype: torch.dtype) -> str:
    """How stats and logs name a cache dtype (``bfloat16``, ``fp8_e4m3``)."""
    return "fp8_e4m3" if dtype == FP8 else str(dtype).removeprefix("torch.")


def is_fp8(kv_cache: Tensor) -> bool:
    return kv_cache.dtype == FP8


def attach_scales(kv_cache: Tensor, scales: Tensor) -> None:
    """Give an FP8 cache its scales: float32 ``[2, kv_heads]`` (row 0 K, row 1 V) on the cache's device."""
    heads = kv_cache.shape[-2]
    if scales.shape != (2, heads) or scales.dtype != torch.float32 or scales.device != kv_cache.device:
        raise ValueError(f"KV scales must be float32 [2, {heads}] on {kv_cache.device}, got {scales.dtype} "
                         f"{list(scales.shape)} on {scales.device}")
    if not bool((scales > 0).all()):
        raise ValueError("KV scales must be positive")
    setattr(kv_cache, _SCALES, scales)


def scales_of(kv_cache: Tensor) -> Tensor:
    """The FP8 cache's scales [2, kv_heads]; a cache without them (a view, or never given any) is a wiring error."""
    scales: Tensor | None = getattr(kv_cache, _SCALES, None)
    if scales is None:
        raise RuntimeError("FP8 KV cache without scales (attach_scales; a view of the cache does not carry them)")
    return scales


def quantize(x: Tensor, scale: Tensor) -> Tensor:
    """x [..., H, D] -> e4m3 ``x / scale`` saturated at +-448; ``scale`` [H] (per head)."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """e4m3 x [..., H, D] -> ``x * scale`` in ``dtype`` (float32 math, one rounding to ``dtype``)."""
    return (x.float() * scale[:, None]).to(dtype)


def dequantize_kv(kv: Tensor, kv_cache: Tensor, dtype: torch.dtype) -> Tensor:
    """A gathered ``[2, ..., H, D]`` slice of ``kv_cache`` (K then V) in ``dtype``: dequantized with the cache's
    scales when it is FP8, else just cast."""
    if not is_fp8(kv_cache):
        return kv.to(dtype)
    scales = scales_of(kv_cache)
    shape = (2,) + (1,) * (kv.dim() - 3) + (scales.shape[1], 1)
    return (kv.float() * scales.view(shape)).to(dtype)


def dequantize_pair(k: Tensor, v: Tensor, kv_cache: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Gathered K and V ([..., H, D], read from ``kv_cache``) in ``dtype``."""
    if not is_fp8(kv_cache):
        return k.to(dtype), v.to(dtype)
    scales = scales_of(kv_cache)
    return dequantize(k, scales[0], dtype), dequantize(v, scales[1], dtype)


def note_path(backend: str, path: str) -> None:
    """Log once per process which way a backend reads an FP8 cache (in place, or dequantized gathers)."""
    if (backend, path) not in _logged:
        _logged.add((backend, path))
        log.info("FP8 KV cache: %s attention %s", backend, path)
