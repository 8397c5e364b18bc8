"""The scheduler <-> encoder-worker hop (``--encoder-workers``): a vision-only process computes an image's cache
entry ahead of the prefill chunk that needs it and hands it back through shared memory.

The scheduler sends ``EncodeRequest`` (the entry's key and its images' pixel pointers, the same ``EncodeItem``s a
plan's encode job carries) to one encoder. The encoder reads the pixels, runs the vision tower, writes the entry
(rows x embed_width, DeepStack levels side by side: exactly what a model worker would have stored) into a new
segment of the launch (``landing`` segments, named ``emb-...``) or, on CUDA, into a range of its landing pool on
the GPU (ipc/landing.py), and answers ``EncodeDone`` with a pointer to it, or ``EncodeFailed``. The scheduler then
names the landing in a ``StepPlan.mm_import`` (every rank copies it into its embedding store) and is the one process
that ends it: it unlinks a segment, as it does pixels, and sends ``EncodeRelease`` for a pool range, which the
encoder that owns the pool frees.

With ``--shared-encoders`` every replica's scheduler sends to the same encoders: a request names its replica, the
answer goes to that replica's scheduler, and any scheduler may release the pool ranges it was handed.
"""

from __future__ import annotations

from ipc.control import Msg
from ipc.landing import LandingRef
from ipc.steps import EncodeItem


class EncodeRequest(Msg, frozen=True):
    """Scheduler -> encoder worker: compute the entry stored under ``key`` from ``items`` (one image in the
    per-image cache), whose pixels stay in shared memory until the encoder has answered."""

    key: bytes
    items: list[EncodeItem]
    # The asking scheduler's replica: a shared encoder (--shared-encoders) answers that replica's scheduler. 0 for an
    # encoder of one replica, which has only its own to answer.
    replica: int = 0


class EncodeDone(Msg, frozen=True):
    """Encoder worker -> scheduler: ``key``'s entry, ``rows`` rows, landed at ``embeddings`` (a segment, or a range
    of the encoder's CUDA landing pool)."""

    encoder: int
    key: bytes
    rows: int
    embeddings: LandingRef


class EncodeFailed(Msg, frozen=True):
    """Encoder worker -> scheduler: ``key`` could not be encoded. ``status`` 400: the request's pixels are at fault
    (they do not match the image's grid, or cannot be read as pixels); 5xx: the encoder or the host is."""

    encoder: int
    key: bytes
    status: int
    error: str


class EncodeRelease(Msg, frozen=True):
    """Scheduler -> encoder worker: no plan will import the pool landings ``names`` (``CudaLanding.name``) any more
    (the steps that imported them are over, or their waiters ended): their ranges are free again."""

    names: list[str]
