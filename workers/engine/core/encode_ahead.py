"""Encoding ahead (``--encode-ahead-tokens``): a step also encodes images that a *later* step will read, and the
model worker runs those encodes on a second CUDA stream after it has queued the step's forward, so the ViT overlaps
the language model instead of lengthening the step that first reads the image.

Without it an image is encoded inside the step whose chunk first reaches it, and every decode row of that step waits
for the ViT (issue 36: the long inter-token gaps under load are such steps). With it, each step picks images up to
the budget, in order: the images of running sequences past this step's chunks, then those of the waiting queue's
head (a new request's first chunk usually starts at its image, so only a waiting request's image can be encoded
before the step that admits it). Each must be in neither tier of the embedding cache, not read by this step, and
have its pixels written (not pending).

The picked images go to the embedding-cache index with the step's own (after them, so they never crowd out an image
the step reads) and are admitted like any encode; one the GPU tier would only take for this step (transient) is not
worth encoding early and is dropped. The plan carries them as the last ``encode_ahead`` jobs of ``encode``, so
failure handling and the pixel bookkeeping see one list. A picked image whose request is later aborted, that is
evicted before its chunk, or that a waiting request's prefix-cache hit turns out to cover, costs an encode and
nothing else.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from ipc.prompts import MMItem
from ipc.steps import EncodeJob
from workers.engine.core.mm_cache import EmbeddingCacheIndex
from workers.engine.core.sequence import Sequence

# Waiting requests looked at per step: the next ones to be admitted (a deep queue is not scanned every step).
WAITING_SCAN = 16


def pick(
    running: Iterable[Sequence], waiting: Iterable[Sequence], needed: dict[bytes, list[MMItem]],
    index: EmbeddingCacheIndex, budget: int,
) -> dict[bytes, list[MMItem]]:
    """Images to encode ahead (key -> items, like the step's ``needed``), up to ``budget`` image tokens; at least
    one image when the budget is positive, so an image larger than it still goes ahead alone."""
    picked: dict[bytes, list[MMItem]] = {}
    left = budget
    queue = itertools.islice(waiting, WAITING_SCAN)
    for seq, past in [*((s, s.num_scheduled) for s in running), *((s, 0) for s in queue)]:
        for item in sorted(seq.items, key=lambda it: it.offset):
            key = item.hash
            if (item.offset + item.length <= past or key in needed or key in picked or key in index
                    or key in index.host or key in seq.pending):
                continue
            if item.length > left and picked:
                return picked
            picked[key] = [item]
            left -= item.length
            if left <= 0:
                return picked
    return picked


def split(jobs: list[EncodeJob], ahead: dict[bytes, list[MMItem]]) -> tuple[list[EncodeJob], int]:
    """The index's jobs for a step's images and the picked ones, as the plan carries them: the step's first, then
    the picked images the GPU tier admitted (transient ones dropped); and how many of the latter there are."""
    now = [job for job in jobs if job.key not in ahead]
    later = [job for job in jobs if job.key in ahead and not job.transient]
    return now + later, len(later)
