"""Where an encoder worker's entry landed (``--encoder-workers``): a shared-memory segment, a range of the
encoder's CUDA landing pool that other processes of the host open through CUDA IPC, or a range of a pool the
encoder registered with a NIXL agent, which a model rank reads with a NIXL transfer (``--encoder-transport nixl``:
the transport that also crosses hosts).

``EncodeDone`` and ``EmbeddingImport`` carry a ``LandingRef``, a tagged union of the three. ``ShmLanding`` is a
``ShmRef`` (its pixels' pointer type) with a tag, so everything that maps a segment takes it unchanged, while the
pixel pointers in every other message keep their untagged (smaller) encoding. All carry a ``name``: the
scheduler's currency for "this landing is no longer needed" (unlinked for a segment, released to its encoder for a
pool range), so one set of deferral rules covers them.

No torch here: the pool's IPC handle travels as the plain fields ``torch.UntypedStorage._share_cuda_()`` returns
(``CudaPoolHandle``), and the receiving side (workers/engine/runner/landing.py) rebuilds the storage from them.
"""

from __future__ import annotations

import msgspec

from ipc.shm import ShmRef

# A pool range's name starts with one of these; a shared-memory segment's never does (segment_name: the launch's
# prefix).
CUDA_LANDING_PREFIX = "cuda:"
NIXL_LANDING_PREFIX = "nixl:"


class ShmLanding(ShmRef, frozen=True, tag="shm", tag_field="via"):
    """The entry is the whole tensor of shared-memory segment ``name`` (the scheduler unlinks it)."""


class CudaPoolHandle(msgspec.Struct, frozen=True, array_like=True):
    """An encoder's landing pool as ``torch.UntypedStorage._share_cuda_()`` describes it (the arguments of
    ``torch.UntypedStorage._new_shared_cuda``, in that order). ``device`` is the index of the pool's GPU in the
    host's numbering (glimpse processes all see every GPU and pick theirs as ``cuda:N``)."""

    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class CudaLanding(msgspec.Struct, frozen=True, tag="cuda", tag_field="via"):
    """The entry is bytes [offset, offset + nbytes) of encoder ``encoder``'s CUDA landing pool ``pool``, a
    contiguous tensor of ``dtype`` and ``shape``. The encoder synchronized its copy before answering, so the bytes
    are complete for whoever reads them after the answer; the range stays the entry's until the scheduler sends
    ``EncodeRelease`` with ``name``."""

    name: str
    encoder: int
    pool: CudaPoolHandle
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


class NixlLanding(msgspec.Struct, frozen=True, tag="nixl", tag_field="via"):
    """The entry is bytes [addr, addr + nbytes) of memory ``mem`` ("DRAM" or "VRAM", GPU ``device``) that encoder
    ``encoder`` registered with its NIXL agent ``agent``; ``metadata`` is that agent's (``get_agent_metadata``), so a
    reader that has not met the agent yet can add it. Complete when the answer leaves (the encoder synchronized its
    copy); the range stays the entry's until the scheduler sends ``EncodeRelease`` with ``name``."""

    name: str
    encoder: int
    agent: str
    metadata: bytes
    mem: str
    device: int
    addr: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


LandingRef = ShmLanding | CudaLanding | NixlLanding
PoolLanding = CudaLanding | NixlLanding  # a range of an encoder's pool: released to the encoder, never unlinked


def is_pool_landing(name: str) -> bool:
    """Whether ``name`` is a range of an encoder's pool (CUDA or NIXL), not a shared-memory segment."""
    return name.startswith((CUDA_LANDING_PREFIX, NIXL_LANDING_PREFIX))


def cuda_landing_name(encoder: int, serial: int) -> str:
    """The name of encoder ``encoder``'s ``serial``-th pool landing (unique in the launch)."""
    return f"{CUDA_LANDING_PREFIX}e{encoder}x{serial:x}"


def nixl_landing_name(encoder: int, serial: int) -> str:
    """The name of encoder ``encoder``'s ``serial``-th NIXL pool landing (unique in the launch)."""
    return f"{NIXL_LANDING_PREFIX}e{encoder}x{serial:x}"
