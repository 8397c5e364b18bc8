"""The model worker's host-RAM pool of KV blocks under the prefix cache (the index lives in the scheduler:
workers/engine/core/host_kv_index.py; the worker obeys the plan's ``kv_spill`` / ``kv_load`` lists).

Every device cache gets a host twin with the same per-layer block layout (block axis 1), ``num_slots`` blocks long.
Copies are raw bytes, so an FP8 cache's blocks stay valid under the scales attached to the device tensor.
"""

from __future__ import annotations

import itertools
import logging
import math
import weakref

import torch
from torch import Tensor

from workers.engine.config import EngineConfig
from workers.engine.kernels import kv_quant
from workers.engine.models.model_spec import ModelSpec

log = logging.getLogger("glimpse.model")

_ALIGN = 64  # bytes: each layer's twin starts on a cache line (and on its element size)


def _raw(t: Tensor) -> Tensor:
    return t.view(torch.uint8) if kv_quant.is_fp8(t) else t  # bytes: not every device indexes e4m3


class HostKVPool:
    """Host twins of the device KV caches; pinned on CUDA so the copies can run asynchronously."""

    def __init__(self, caches: list[Tensor], num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.caches = caches
        self.num_slots = num_slots
        self.device = caches[0].device
        self.spilled = 0  # blocks copied device -> host (the scheduler's index counts the same)
        self.loaded = 0  # blocks copied host -> device
        shapes = [(c.shape[0], num_slots, *c.shape[2:]) for c in caches]
        sizes = [-(-math.prod(shape) * c.element_size() // _ALIGN) * _ALIGN for shape, c in zip(shapes, caches, strict=True)]
        # One allocation for every layer's twin, pinned on CUDA by registering plain memory: torch's pinned allocator
        # rounds each request up to a power of two, which could lock up to twice the budget (as host_embeddings.py).
        self.buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        if self.device.type == "cuda":  # pinning needs a CUDA context; the CPU path copies plainly
            nbytes = self.buffer.numel()
            if (rc := int(torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0))) != 0:
                raise RuntimeError(f"pinning {nbytes >> 20} MiB for the KV host tier failed (cudaError {rc}): lower "
                                   "--kv-host-cache-mb")  # fmt: skip
            weakref.finalize(self, _unpin, self.buffer)  # (the callback holds the buffer: it outlives the pinning)
        offsets = [0, *itertools.accumulate(sizes)]
        self.host = [
            self.buffer[offsets[i] : offsets[i] + math.prod(shape) * c.element_size()].view(c.dtype).view(shape)
            for i, (shape, c) in enumerate(zip(shapes, caches, strict=True))
        ]

    @staticmethod
    def bytes_per_slot(caches: list[Tensor]) -> int:
        """Host bytes one block takes across every layer (sizes the pool from the megabyte budget)."""
        return sum(c[:, 0].numel() * c.element_size() for c in caches)

    def apply(self, spill: list[tuple[int, int]], load: list[tuple[int, int]]) -> None:
        """The step's copies, spills first (their blocks are reused this step), then loads, before the forward."""
        self.spilled += len(spill)
        self.loaded += len(load)
        if spill:
            blocks = torch.tensor([b for b, _ in spill], device=self.device)
            slots = torch.tensor([s for _, s in spill])
            for dev, host in zip(self.caches, self.host, strict=True):
                # Gather on the device, one transfer per layer; the host write must finish before a load reads it.
                _raw(host)[:, slots] = _raw(dev)[:, blocks].to("cpu")
        if load:
            slots = torch.tensor([s for s, _ in load])
            blocks = torch.tensor([b for _, b in load], device=self.device)
            non_blocking = self.device.type == "cuda"  # the source is pinned; the forward follows on the same stream
            for dev, host in zip(self.caches, self.host, strict=True):
                staged = _raw(host)[:, slots]
                if non_blocking:
                    staged = staged.pin_memory()
                _raw(dev)[:, blocks] = staged.to(self.device, non_blocking=non_blocking)


def _unpin(buffer: Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def host_kv_pool(cfg: EngineConfig, spec: ModelSpec, caches: list[Tensor]) -> HostKVPool | None:
    """This rank's pool for --kv-host-cache-mb (as many whole blocks as the budget holds), or None when it is off.
    ValueError (one line, naming the flag) where the tier cannot serve the model (EngineConfig.kv_host_cache_refusal).
    Every rank's blocks are the same size, so every rank gets the same count, which goes to the scheduler."""
    if (why := cfg.kv_host_cache_refusal(spec)) is not None:
        raise ValueError(why)
    if cfg.kv_host_cache_mb <= 0:
        return None
    per_slot = HostKVPool.bytes_per_slot(caches)
    slots = int(cfg.kv_host_cache_mb * 2**20) // per_slot
    if slots <= 0:
        log.warning("--kv-host-cache-mb %g holds no KV block (%d bytes each): the host tier is off",
                    cfg.kv_host_cache_mb, per_slot)
        return None
    log.info("KV host tier: %d blocks of %d bytes", slots, per_slot)
    return HostKVPool(caches, slots)
