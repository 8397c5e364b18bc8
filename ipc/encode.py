"""The scheduler <-> encoder-worker hop (``--encoder-workers``): a vision-only process computes an image's cache
entry ahead of the prefill chunk that needs it and hands it back through shared memory.

The scheduler sends ``EncodeRequest`` (the entry's key and its images' pixel pointers, the same ``EncodeItem``s a
plan's encode job carries) to one encoder. The encoder reads the pixels, runs the vision tower, writes the entry
(rows x embed_width, DeepStack levels side by side: exactly what a model worker would have stored) into a new
segment of the launch (``landing`` segments, named ``emb-...``), and answers ``EncodeDone`` with a pointer to it,
or ``EncodeFailed``. The scheduler then names the segment in a ``StepPlan.mm_import`` (every rank copies it into
its embedding store) and is the one process that unlinks it, as it is for pixels.
"""

from __future__ import annotations

from ipc.control import Msg
from ipc.shm import ShmRef
from ipc.steps import EncodeItem


class EncodeRequest(Msg, frozen=True):
    """Scheduler -> encoder worker: compute the entry stored under ``key`` from ``items`` (one image in the
    per-image cache), whose pixels stay in shared memory until the encoder has answered."""

    key: bytes
    items: list[EncodeItem]


class EncodeDone(Msg, frozen=True):
    """Encoder worker -> scheduler: ``key``'s entry, ``rows`` rows, is in the landing segment ``embeddings``."""

    encoder: int
    key: bytes
    rows: int
    embeddings: ShmRef


class EncodeFailed(Msg, frozen=True):
    """Encoder worker -> scheduler: ``key`` could not be encoded. ``status`` 400: the request's pixels are at fault
    (they do not match the image's grid, or cannot be read as pixels); 5xx: the encoder or the host is."""

    encoder: int
    key: bytes
    status: int
    error: str
