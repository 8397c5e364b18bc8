"""An encoder worker's NIXL landing pool (``--encoder-transport nixl``): one uint8 buffer on the encoder's device
(host memory on the CPU, GPU memory on CUDA) registered once with the encoder's NIXL agent. Each answer names a
range of it with the agent's metadata (ipc/landing.py ``NixlLanding``); the model rank that imports the entry reads
the range with a NIXL transfer (workers/engine/runner/nixl_reader.py), in the same host or from another, and the
range stays the entry's until the scheduler releases it, as for the CUDA pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ipc.landing import NixlLanding, nixl_landing_name
from ipc.shm import dtype_name
from workers.common.nixl import make_agent, mem_type
from workers.encoder.landing_pool import RangeAllocator
from workers.encoder.pool import LandingPool

log = logging.getLogger("glimpse.encoder")


@dataclass
class NixlLandingPool(LandingPool):
    """Encoder ``encoder``'s registered pool and the agent that serves reads of it."""

    agent: Any = field(kw_only=True)
    registered: Any = field(kw_only=True)  # the registration, given back on close (None once it is)
    metadata: bytes = field(kw_only=True)

    def describe(self, serial: int, offset: int, nbytes: int, entry: torch.Tensor) -> NixlLanding:
        device = (self.buffer.device.index or 0) if self.buffer.is_cuda else 0
        return NixlLanding(nixl_landing_name(self.encoder, serial), self.encoder, self.agent.name, self.metadata,
                           mem_type(self.buffer), device, self.buffer.data_ptr() + offset, nbytes,
                           dtype_name(entry.dtype), tuple(entry.shape))

    def close(self) -> None:
        if self.registered is not None:
            self.agent.deregister_memory(self.registered)
            self.registered = None


def open_nixl_pool(encoder: int, device: torch.device, nbytes: int, launch_id: str) -> NixlLandingPool:
    """The pool of ``nbytes`` on ``device``, registered with a fresh agent named after the launch and the encoder
    (raises NixlMissing where NIXL cannot be imported or has no UCX)."""
    agent = make_agent(f"glimpse-{launch_id}-e{encoder}")
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        registered = agent.register_memory(buffer)
    except Exception as exc:  # e.g. a UCX build without this GPU's CUDA: say which flag avoids it
        raise RuntimeError(f"NIXL cannot register {nbytes >> 20} MiB of {mem_type(buffer)} on {device} ({exc}); "
                           "run with --encoder-transport local") from exc
    log.info("NIXL landing pool: %d MiB of %s on %s, agent %s", nbytes >> 20, mem_type(buffer), device, agent.name)
    return NixlLandingPool(encoder, buffer, RangeAllocator(nbytes), agent=agent, registered=registered,
                           metadata=agent.get_agent_metadata())
