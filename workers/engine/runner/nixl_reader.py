"""A model rank's side of ``--encoder-transport nixl``: an entry an encoder landed in its NIXL-registered pool
(ipc/landing.py ``NixlLanding``) is read with one NIXL READ into a staging buffer of this rank's, registered once
(and again, larger, when an entry outgrows it), on the rank's device: GPU memory on CUDA, so UCX moves the bytes
GPU to GPU where the fabric allows.

The agent is made at a serving worker's start-up (else on the first NIXL landing), and an encoder's agent is added
from the metadata its landing carries, once. A read is waited for before ``rows`` returns: the scheduler releases the range once the step
is over, and the caller copies the rows into the embedding store at once, so one staging buffer serves every import
of a step in turn (on CUDA the previous copy out of it is waited for before the next read overwrites it).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch

from ipc.landing import NixlLanding
from ipc.shm import parse_dtype
from workers.common.nixl import make_agent

# A read that takes longer than this has lost its encoder (NIXL reports no error for a peer that stopped answering).
READ_TIMEOUT_S = 60.0


class NixlReader:
    """Reads of NIXL landings into this rank's staging buffer on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._agent: Any = None
        self._remotes: set[str] = set()
        self._staging: torch.Tensor | None = None
        self._registered: Any = None
        self.reads = 0
        self.bytes_read = 0

    def rows(self, ref: NixlLanding) -> torch.Tensor:
        """The entry at ``ref``, read into the staging buffer: a view valid until the next read."""
        agent = self._agent_for(ref)
        staging = self._buffer(ref.nbytes)
        local = agent.get_xfer_descs(staging[:ref.nbytes])
        remote = agent.get_xfer_descs([(ref.addr, ref.nbytes, ref.device)], ref.mem)
        handle = agent.initialize_xfer("READ", local, remote, ref.agent)
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + READ_TIMEOUT_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"NIXL read of landing {ref.name} from {ref.agent} took over {READ_TIMEOUT_S}s")
                time.sleep(0)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL read of landing {ref.name} from {ref.agent} failed ({state})")
        finally:
            agent.release_xfer_handle(handle)
        self.reads += 1
        self.bytes_read += ref.nbytes
        return staging[:ref.nbytes].view(parse_dtype(ref.dtype)).view(ref.shape)

    def start(self) -> None:
        """Make the agent now (a serving worker does, at start-up) rather than at the first NIXL landing."""
        if self._agent is None:
            # Host and pid: an encoder may serve readers of several hosts, whose pids can be equal.
            self._agent = make_agent(f"glimpse-reader-{socket.gethostname()}-{os.getpid()}")

    def _agent_for(self, ref: NixlLanding) -> Any:
        self.start()
        if ref.agent not in self._remotes:
            self._agent.add_remote_agent(ref.metadata)
            self._remotes.add(ref.agent)
        return self._agent

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._staging is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the last copy out of it is done
        if self._staging is None or self._staging.numel() < nbytes:
            self._release_buffer()
            size = max(nbytes, 2 * (self._staging.numel() if self._staging is not None else 0))
            self._staging = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._registered = self._agent.register_memory(self._staging)
        return self._staging

    def _release_buffer(self) -> None:
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None

    def close(self) -> None:
        if self._agent is not None:
            self._release_buffer()
            self._staging = None
