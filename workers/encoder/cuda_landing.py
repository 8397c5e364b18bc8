"""An encoder worker's CUDA landing pool (``--encoder-landing-mb``): one uint8 tensor on the encoder's GPU, allocated
once at start-up and shared once through CUDA IPC, whose ranges (landing_pool.py) hold entries until the scheduler
releases them (``EncodeRelease``). A model rank opens the pool once (workers/engine/runner/landing.py) and copies an
entry device to device, or peer to peer from another GPU of the host, instead of GPU -> host -> /dev/shm -> host ->
GPU.

The pool exists only where every rank that will read it can: ``open_pool`` checks peer access from each of the
replica's LM GPUs and that the allocation can be exported; otherwise (and on the CPU) entries land in shared memory
as before. A full pool sends one entry to shared memory, not the request to an error.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from ipc.landing import CudaLanding, CudaPoolHandle, cuda_landing_name
from ipc.shm import dtype_name
from workers.encoder.landing_pool import RangeAllocator

log = logging.getLogger("glimpse.encoder")


@dataclass
class CudaLandingPool:
    """Encoder ``encoder``'s pool: ``buffer`` on its GPU, ``handle`` as receivers reopen it, and the ranges live."""

    encoder: int
    buffer: torch.Tensor
    handle: CudaPoolHandle
    ranges: RangeAllocator
    live: dict[str, int] = field(default_factory=dict)  # landing name -> offset
    _serial: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def size(self) -> int:
        return self.ranges.size

    @property
    def used_bytes(self) -> int:
        return self.ranges.used_bytes

    def land(self, entry: torch.Tensor) -> CudaLanding | None:
        """``entry`` copied into a fresh range, the copy finished before this returns (the answer that names the
        range may be read the moment it leaves); None when no range fits (the caller lands it in shared memory)."""
        if entry.device != self.buffer.device:
            return None
        entry = entry.contiguous()
        nbytes = entry.numel() * entry.element_size()
        offset = self.ranges.carve(nbytes) if nbytes else None
        if offset is None:
            return None
        self.buffer[offset:offset + nbytes].copy_(entry.reshape(-1).view(torch.uint8))
        # The reader copies on its own stream in its own process: nothing orders it after this copy but this wait.
        torch.cuda.current_stream(self.buffer.device).synchronize()
        name = cuda_landing_name(self.encoder, next(self._serial))
        self.live[name] = offset
        return CudaLanding(name, self.encoder, self.handle, offset, nbytes, dtype_name(entry.dtype),
                           tuple(entry.shape))

    def release(self, names: list[str]) -> int:
        """Free the ranges of ``names`` (unknown names are ignored: a release is never repeated, but a stale one
        must not take another entry's range); the number freed."""
        freed = 0
        for name in names:
            offset = self.live.pop(name, None)
            if offset is not None:
                self.ranges.free(offset)
                freed += 1
        return freed


def open_pool(encoder: int, device: torch.device, nbytes: int, reader_devices: list[int]) -> CudaLandingPool | None:
    """The pool of ``nbytes`` on ``device``, or None (entries then land in shared memory) when it is off, on the
    CPU, or some reader GPU in ``reader_devices`` cannot map memory of ``device`` (no peer access), or the
    allocation cannot be exported through CUDA IPC."""
    if nbytes <= 0 or device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    blocked = [d for d in reader_devices if d != index and not torch.cuda.can_device_access_peer(d, index)]
    if blocked:
        log.warning("no CUDA landing pool: GPUs %s cannot access GPU %d; entries land in shared memory", blocked, index)
        return None
    try:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
        shared = buffer.untyped_storage()._share_cuda_()
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        log.warning("no CUDA landing pool of %d MiB on GPU %d (%s); entries land in shared memory", nbytes >> 20,
                    index, exc)
        return None
    handle = CudaPoolHandle(int(shared[0]), bytes(shared[1]), int(shared[2]), int(shared[3]), bytes(shared[4]),
                            int(shared[5]), bytes(shared[6] or b""), bool(shared[7]))
    log.info("CUDA landing pool: %d MiB on GPU %d, read by GPUs %s", nbytes >> 20, index, reader_devices)
    return CudaLandingPool(encoder, buffer, handle, RangeAllocator(nbytes))
