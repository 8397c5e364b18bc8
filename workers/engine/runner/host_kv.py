"""The model worker's host-RAM pool of KV blocks under the prefix cache (the index lives in the scheduler:
workers/engine/core/host_kv_index.py; the worker obeys the plan's ``kv_spill`` / ``kv_load`` lists).

Every device cache gets a host twin with the same per-layer block layout (block axis 1), ``num_slots`` blocks long.
Copies are raw bytes, so an FP8 cache's blocks stay valid under the scales attached to the device tensor.

On CUDA the twins are pinned and mapped, and the copies are GPU kernels that read and write them in place across
the bus: one gather and one scatter per layer, queued on the compute stream, with no host work and no staging copy.
Gathering on the host instead (then pinning the gathered rows, then one transfer) ran at ~2 GB/s on an H200 host, so
a returning 40k-token chat took as long to load as to recompute. Stream order keeps a step's spills before its
loads and before the forward, as on the CPU path.
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
from workers.engine.runner.pinned_host import HOST_REGISTER_MAPPED, pinned_host_memory, unpin

log = logging.getLogger("glimpse.model")

_ALIGN = 64  # bytes: each layer's twin starts on a cache line (and on its element size)
_CHUNK_BYTES = 64 << 20  # device scratch per gather: a load of thousands of blocks must not need a layer's worth


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
        # One allocation for every layer's twin, pinned and mapped on CUDA (pinned_host.py); the CPU path copies plainly.
        cuda = self.device.type == "cuda"
        self.buffer = pinned_host_memory(sum(sizes), cuda, "KV host tier", "--kv-host-cache-mb", HOST_REGISTER_MAPPED)
        if cuda:
            weakref.finalize(self, unpin, self.buffer)  # (the callback holds the buffer: it outlives the pinning)
        offsets = [0, *itertools.accumulate(sizes)]

        def twins(buffer: Tensor) -> list[Tensor]:
            return [
                buffer[offsets[i] : offsets[i] + math.prod(shape) * c.element_size()].view(c.dtype).view(shape)
                for i, (shape, c) in enumerate(zip(shapes, caches, strict=True))
            ]

        self.host = twins(self.buffer)
        # The same bytes as CUDA tensors (None: not CUDA, or the mapping failed its check and copies are staged).
        mapped = _mapped_view(self.buffer, self.device) if self.device.type == "cuda" else None
        self.mapped = twins(mapped) if mapped is not None else None

    @staticmethod
    def bytes_per_slot(caches: list[Tensor]) -> int:
        """Host bytes one block takes across every layer (sizes the pool from the megabyte budget)."""
        return sum(c[:, 0].numel() * c.element_size() for c in caches)

    def apply(self, spill: list[tuple[int, int]], load: list[tuple[int, int]]) -> None:
        """The step's copies, spills first (their blocks are reused this step), then loads, before the forward."""
        self.spilled += len(spill)
        self.loaded += len(load)
        if self.mapped is not None:
            self._apply_mapped(spill, load)
            return
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

    def _apply_mapped(self, spill: list[tuple[int, int]], load: list[tuple[int, int]]) -> None:
        """CUDA: gather the rows on one side and scatter them on the other, in chunks that bound the scratch."""
        assert self.mapped is not None
        for pairs, reading in ((spill, False), (load, True)):
            if not pairs:
                continue
            pairs_t = torch.tensor(pairs, dtype=torch.int64, device=self.device)
            for dev, twin in zip(self.caches, self.mapped, strict=True):
                dev, twin = _raw(dev), _raw(twin)
                src, dst = (twin, dev) if reading else (dev, twin)
                step = max(1, _CHUNK_BYTES // (dev[:, 0].numel() * dev.element_size()))
                for i in range(0, len(pairs), step):
                    chunk = pairs_t[i : i + step]
                    # spill pairs are (block, slot), load pairs (slot, block): column 0 is always the source.
                    dst.index_copy_(1, chunk[:, 1], src.index_select(1, chunk[:, 0]))


class _CudaArray:
    """A host allocation described to torch as device memory (``__cuda_array_interface__``)."""

    def __init__(self, buffer: Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": (buffer.numel(),),
            "typestr": "|u1",
            "data": (buffer.data_ptr(), False),
            "version": 3,
        }


def _mapped_view(buffer: Tensor, device: torch.device) -> Tensor | None:
    """``buffer`` (uint8, pinned with cudaHostRegisterMapped) as a CUDA tensor over the same bytes, or None (logged)
    where the device does not reach it at the host address: then the staged copies serve instead."""
    try:
        with torch.cuda.device(device):
            view = torch.as_tensor(_CudaArray(buffer), device=device)
            probe = torch.arange(min(buffer.numel(), 4096), dtype=torch.int64).remainder_(251).to(torch.uint8)
            buffer[: probe.numel()] = probe
            seen = view[: probe.numel()].cpu()  # read by the device, across the bus
            view[: probe.numel()].zero_()  # written by the device
            torch.cuda.synchronize(device)
            if torch.equal(seen, probe) and not buffer[: probe.numel()].any():
                return view
            log.warning("KV host tier: the device did not see the pinned pages at their host address; copies staged")
    except (RuntimeError, TypeError) as exc:
        log.warning("KV host tier: no device view of the pinned pages (%s); copies staged", exc)
    return None


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
