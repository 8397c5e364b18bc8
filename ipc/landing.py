"""Where an encoder worker's entry landed (``--encoder-workers``): a shared-memory segment, or a range of the
encoder's CUDA landing pool that other processes of the host open through CUDA IPC.

``EncodeDone`` and ``EmbeddingImport`` carry a ``LandingRef``, a tagged union of the two. ``ShmLanding`` is a
``ShmRef`` (its pixels' pointer type) with a tag, so everything that maps a segment takes it unchanged, while the
pixel pointers in every other message keep their untagged (smaller) encoding. Both carry a ``name``: the
scheduler's currency for "this landing is no longer needed" (unlinked for a segment, released to its encoder for a
pool range), so one set of deferral rules covers both.

No torch here: the pool's IPC handle travels as the plain fields ``torch.UntypedStorage._share_cuda_()`` returns
(``CudaPoolHandle``), and the receiving side (workers/engine/runner/landing.py) rebuilds the storage from them.
"""

from __future__ import annotations

import msgspec

from ipc.shm import ShmRef

# A pool range's name starts with this; a shared-memory segment's never does (segment_name: the launch's prefix).
CUDA_LANDING_PREFIX = "cuda:"


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


LandingRef = ShmLanding | CudaLanding


def is_cuda_landing(name: str) -> bool:
    return name.startswith(CUDA_LANDING_PREFIX)


def cuda_landing_name(encoder: int, serial: int) -> str:
    """The name of encoder ``encoder``'s ``serial``-th pool landing (unique in the launch)."""
    return f"{CUDA_LANDING_PREFIX}e{encoder}x{serial:x}"
