"""Choosing an attention backend by name: the registry of backends and the ``auto`` rule.

Kept apart from ``attention`` (the interface and the torch backends) because the optional FA3 and FA4 backends
build on that interface, and the choice has to see them all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import torch

from workers.engine.kernels import fa3_attention, fa4_attention
from workers.engine.kernels.attention import AttentionBackend
from workers.engine.kernels.torch_attention import FlashVarlenBackend, SdpaBackend, flash_available

log = logging.getLogger(__name__)

BackendName = Literal["sdpa", "flash", "fa3", "fa4", "auto"]
_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {
    "sdpa": SdpaBackend,
    "flash": FlashVarlenBackend,
}


def register_attention_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    """Add a backend under ``name`` (later backends, e.g. Triton paged decode, plug in here)."""
    _REGISTRY[name] = factory


def get_attention_backend(name: BackendName | str, device: torch.device | str) -> AttentionBackend:
    """Return a backend instance. ``auto`` picks fa4 (FlashAttention-4, the declared ``flash-attn-4`` dependency)
    where it serves (a Hopper or Blackwell GPU), else flash on CUDA when torch has varlen attention, else sdpa.
    ``fa3`` (an installed build of vLLM's FlashAttention fork) only when asked for. Logs the one it returns."""
    backend = _choose(name, torch.device(device))
    log.info("attention backend: %s", backend.name)
    return backend


def _choose(name: str, device: torch.device) -> AttentionBackend:
    usable = device.type == "cuda" and torch.cuda.is_available() and flash_available()
    if name in ("fa4", "auto"):
        if fa4_attention.serves(name, device):
            return fa4_attention.FA4PagedBackend()
        if name == "fa4":
            log.warning("FlashAttention-4 unavailable (%s); using the default backend",
                        fa4_attention.unavailable_reason(device))
        elif usable:  # a CUDA GPU: say why auto settles for FlashAttention-2
            log.info("FlashAttention-4 unavailable (%s)", fa4_attention.unavailable_reason(device))
        name = "auto"
    if name == "fa3":
        if fa3_attention.serves(name, device):
            return fa3_attention.FA3PagedBackend()
        log.warning("FlashAttention-3 unavailable (%s); using the default backend",
                    fa3_attention.unavailable_reason(device))
        name = "auto"
    if name == "auto":
        name = "flash" if usable else "sdpa"
    if name == "flash" and not usable:
        log.warning("flash attention unavailable on %s with torch %s; using sdpa", device, torch.__version__)
        name = "sdpa"
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def vision_kernel(name: str, device: torch.device | str) -> Any | None:
    """The packed FlashAttention call for the ViT's full blocks when the model's attention runs on FA3 or FA4 (that
    backend's own kernel), else None: the tower keeps its default kernels."""
    return fa4_attention.vision_kernel(name, device) or fa3_attention.vision_kernel(name, device)
