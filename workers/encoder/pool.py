"""What every encoder landing pool shares (cuda_landing.py's CUDA IPC pool, nixl_landing.py's NIXL pool): one uint8
buffer allocated at start-up, ranges of it (landing_pool.py) holding entries until the scheduler releases them
(``EncodeRelease``), and the answer's reference to a range, which each transport describes its own way.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ipc.landing import PoolLanding
from workers.encoder.landing_pool import RangeAllocator


@dataclass
class LandingPool:
    """Encoder ``encoder``'s ``buffer`` and the ranges live in it."""

    encoder: int
    buffer: torch.Tensor
    ranges: RangeAllocator
    live: dict[str, int] = field(default_factory=dict)  # landing name -> offset
    _serial: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def size(self) -> int:
        return self.ranges.size

    @property
    def used_bytes(self) -> int:
        return self.ranges.used_bytes

    def describe(self, serial: int, offset: int, nbytes: int, entry: torch.Tensor) -> PoolLanding:
        """The reference a reader follows to the range (the transport's own)."""
        raise NotImplementedError

    def land(self, entry: torch.Tensor) -> PoolLanding | None:
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
        if self.buffer.is_cuda:
            # The reader copies in its own process: nothing orders it after this copy but this wait.
            torch.cuda.current_stream(self.buffer.device).synchronize()
        ref = self.describe(next(self._serial), offset, nbytes, entry)
        self.live[ref.name] = offset
        return ref

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

    def close(self) -> None:
        """Give back what the transport holds (nothing for a CUDA pool: its memory goes with the process)."""
