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
    """Return a backend instance. ``auto`` picks fa3 where an FA3 build loads on a Hopper GPU, else flash on CUDA
    when torch has varlen attention, else sdpa. ``fa4`` (FlashAttention-4 from pip) only when asked for."""
    device = torch.device(device)
    usable = device.type == "cuda" and torch.cuda.is_available() and flash_available()
    if name == "fa4":
        if fa4_attention.serves(name, device):
            return fa4_attention.FA4PagedBackend()
        log.warning("FlashAttention-4 unavailable (%s); using the default backend",
                    fa4_attention.unavailable_reason(device))
        name = "auto"
    if name in ("fa3", "auto"):
        if fa3_attention.serves(name, device):
            return fa3_attention.FA3PagedBackend()
        if name == "fa3":
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
