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

import logging
from dataclasses import dataclass, field

import torch

from ipc.landing import CudaLanding, CudaPoolHandle, cuda_landing_name
from ipc.shm import dtype_name
from workers.encoder.landing_pool import RangeAllocator
from workers.encoder.pool import LandingPool

log = logging.getLogger("glimpse.encoder")


@dataclass
class CudaLandingPool(LandingPool):
    """Encoder ``encoder``'s pool on its GPU, with ``handle`` as receivers reopen it."""

    handle: CudaPoolHandle = field(kw_only=True)

    def describe(self, serial: int, offset: int, nbytes: int, entry: torch.Tensor) -> CudaLanding:
        return CudaLanding(cuda_landing_name(self.encoder, serial), self.encoder, self.handle, offset, nbytes,
                           dtype_name(entry.dtype), tuple(entry.shape))


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
    return CudaLandingPool(encoder, buffer, RangeAllocator(nbytes), handle=handle)
