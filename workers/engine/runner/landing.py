"""A model rank's side of encoder workers' landings (``StepPlan.mm_import``): the entry's rows read from its landing
segment, from a range of the encoder's CUDA landing pool (ipc/landing.py), or through NIXL (nixl_reader.py), and
copied into the embedding store.

A pool is opened through CUDA IPC once per (encoder, handle) and kept for the life of the process: opening is a
``cudaIpcOpenMemHandle``, far too slow per entry, and the pool never moves while its encoder lives (an encoder that
dies stops the server). The storage is opened on the pool's own GPU, so an entry is copied device to device on the
colocated GPU and peer to peer from another GPU of the host. ``close`` drops the pools before the process exits, so
the encoder's reference counts fall back and nothing of its memory is left mapped here.
"""

from __future__ import annotations

import logging

import torch

from ipc.landing import CudaLanding, CudaPoolHandle, LandingRef, NixlLanding
from ipc.shm import ShmSegment, parse_dtype
from workers.engine.runner.nixl_reader import NixlReader

log = logging.getLogger("glimpse.model")


class LandingOpenError(RuntimeError):
    """An encoder's CUDA landing pool could not be mapped in this process (no CUDA IPC between the two GPUs)."""


class LandingReader:
    """The entries of a plan's imports, as tensors a rank can copy from; pools opened once and cached."""

    def __init__(self, device: torch.device) -> None:
        self._pools: dict[tuple[int, bytes], torch.Tensor] = {}  # (encoder, IPC handle) -> the pool as uint8
        self.nixl = NixlReader(device)  # NIXL landings read into a staging buffer on the rank's ``device``

    @property
    def pools(self) -> int:
        return len(self._pools)

    def rows(self, ref: LandingRef) -> torch.Tensor:
        """The entry at ``ref``: a view of the pool (valid until the scheduler releases the range, after this step)
        or of the mapped segment (its pages kept mapped by the view only until the caller's copy is done), or of
        the NIXL staging buffer (valid until the next NIXL read)."""
        if isinstance(ref, NixlLanding):
            return self.nixl.rows(ref)
        if isinstance(ref, CudaLanding):
            pool = self._pool(ref.encoder, ref.pool)
            if ref.offset < 0 or ref.offset + ref.nbytes > pool.numel():
                raise RuntimeError(f"landing {ref.name} [{ref.offset}, +{ref.nbytes}) is outside the {pool.numel()} "
                                   f"bytes of encoder {ref.encoder}'s pool")
            return pool[ref.offset:ref.offset + ref.nbytes].view(parse_dtype(ref.dtype)).view(ref.shape)
        with ShmSegment.attach(ref) as seg:
            return seg.tensor(ref)

    def _pool(self, encoder: int, handle: CudaPoolHandle) -> torch.Tensor:
        key = (encoder, handle.handle)
        pool = self._pools.get(key)
        if pool is not None:
            return pool
        try:
            with torch.cuda.device(handle.device):  # the storage is labelled with the current device: the pool's
                storage = torch.UntypedStorage._new_shared_cuda(
                    handle.device, handle.handle, handle.storage_bytes, handle.storage_offset,
                    handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle,
                    handle.event_sync_required,
                )
                pool = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", handle.device))
                pool.set_(storage, 0, (handle.storage_bytes,), (1,))
        except Exception as exc:
            raise LandingOpenError(
                f"cannot open encoder {encoder}'s CUDA landing pool on GPU {handle.device} through CUDA IPC "
                f"({type(exc).__name__}: {exc}); run with --encoder-landing-mb 0 to land entries in shared memory"
            ) from exc
        # A new handle of the same encoder is a new pool (never expected while it lives): the old one goes.
        for old in [k for k in self._pools if k[0] == encoder]:
            del self._pools[old]
        self._pools[key] = pool
        log.info("opened encoder %d's CUDA landing pool (%d MiB on GPU %d)", encoder, handle.storage_bytes >> 20,
                 handle.device)
        return pool

    def close(self) -> None:
        self._pools.clear()
        self.nixl.close()
