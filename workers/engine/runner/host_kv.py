"""The model worker's host-RAM pool of KV blocks under the prefix cache (the index lives in the scheduler:
workers/engine/core/host_kv_index.py; the worker obeys the plan's ``kv_spill`` / ``kv_load`` lists).

Every device cache gets a host twin with the same per-layer block layout (block axis 1), ``num_slots`` blocks long.
Copies are raw bytes, so an FP8 cache's blocks stay valid under the scales attached to the device tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from workers.engine.kernels import kv_quant


def _raw(t: Tensor) -> Tensor:
    return t.view(torch.uint8) if kv_quant.is_fp8(t) else t  # bytes: not every device indexes e4m3


class HostKVPool:
    """Host twins of the device KV caches; pinned on CUDA so the copies can run asynchronously."""

    def __init__(self, caches: list[Tensor], num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.caches = caches
        self.device = caches[0].device
        pin = self.device.type == "cuda"  # pinning needs a CUDA context; the CPU path copies plainly
        self.host = [
            torch.empty((c.shape[0], num_slots, *c.shape[2:]), dtype=c.dtype, pin_memory=pin) for c in caches
        ]

    @staticmethod
    def bytes_per_slot(caches: list[Tensor]) -> int:
        """Host bytes one block takes across every layer (sizes the pool from the megabyte budget)."""
        return sum(c[:, 0].numel() * c.element_size() for c in caches)

    def apply(self, spill: list[tuple[int, int]], load: list[tuple[int, int]]) -> None:
        """The step's copies, spills first (their blocks are reused this step), then loads, before the forward."""
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
