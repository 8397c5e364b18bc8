"""A model worker's vision side of a step: the plan's encode jobs read from shm, run through the ViT and stored, and
the entries encoder workers computed (``--encoder-workers``) copied in from their landing segments. An encoder worker
runs the same ``VisionEncoder`` on its tower alone (workers/encoder/tower.py).

With TP the ViT runs data-parallel: each rank reads and encodes only its share of the step's distinct images (split
by patch count, largest first), then the embeddings are all-gathered so every rank's store ends up with the same
entries. A rank's share runs in ViT calls of at most ``vit_max_patches`` patches each (one image at least), reading
each call's pixels just before it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import AutoImageProcessor

from ipc.steps import EmbeddingImport, EncodeItem, EncodeJob
from workers.engine.core.mm_cache import EmbeddingStore
from workers.engine.layers.linear import TPGroup
from workers.engine.models import family as family_package, load_spec
from workers.engine.models.base import VLModel
from workers.engine.prompt.pixel_frames import FrameLayout, layout_of
from workers.engine.runner.batching import group_by_patches, patches, pixel_rows, split_by_patches
from workers.engine.runner.landing import LandingReader

log = logging.getLogger("glimpse.model")

PixelSource = Callable[[EncodeItem], torch.Tensor]
EncodeFn = Callable[[torch.Tensor, Sequence[tuple[int, int, int]]], torch.Tensor]  # (patch rows, grids) -> rows


@dataclass
class RunnerCounters:
    steps: int = 0
    vit_calls: int = 0
    images_encoded: int = 0
    pixel_reads: int = 0
    imports: int = 0  # entries encoder workers computed, copied in from their landing segments
    encoded_per_step: list[int] = field(default_factory=list)
    keep_per_step: bool = True  # the offline engine and tests read encoded_per_step; a server's worker turns it off


class VisionEncoder:
    """Encode jobs into their cache entries: pixels read from shm, ViT calls of at most ``vit_max_patches``, and
    with TP each rank's share all-gathered. ``encode`` is the tower's call (``VLModel.encode`` in a model worker,
    the tower alone in an encoder worker)."""

    def __init__(self, encode: EncodeFn, tp: TPGroup, pixel_source: PixelSource, counters: RunnerCounters,
                 model_dir: str, merge: int, embed_width: int, vit_max_patches: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.encode, self.tp, self.pixel_source, self.counters = encode, tp, pixel_source, counters
        self.hidden = embed_width  # main embedding and DeepStack levels side by side
        self.vit_max_patches = vit_max_patches
        self.device, self.dtype = device, dtype
        # Images in shm may be uint8 frames (pixel_frames.py): made into rows here, by the processor's own numbers.
        self.frame_layout = _frame_layout(model_dir, merge)

    def entries(self, jobs: list[EncodeJob]) -> tuple[list[torch.Tensor], int]:
        """Each job's entry ([its items' tokens, embed_width], in job order) and the number of distinct images."""
        unique: dict[bytes, EncodeItem] = {}
        for job in jobs:
            for item in job.items:
                unique.setdefault(item.hash, item)
        items = list(unique.values())
        shares = split_by_patches([patches(item.grid) for item in items], self.tp.size)
        mine = [items[i] for i in shares[self.tp.rank]]
        outs: list[torch.Tensor] = []
        for group in group_by_patches(mine, self.vit_max_patches):
            pixels = [self.pixel_source(item) for item in group]
            self.counters.pixel_reads += len(group)
            batch = pixel_rows(pixels, self.device, self.dtype, self.frame_layout)
            outs.append(self.encode(batch, [item.grid for item in group]))
            self.counters.vit_calls += 1
            self.counters.images_encoded += len(group)
        if len(outs) == 1:
            local = outs[0]
        else:  # several ViT calls, or none (this rank's share is empty)
            local = torch.cat(outs) if outs else torch.empty((0, self.hidden), dtype=self.dtype, device=self.device)
        per_hash: dict[bytes, torch.Tensor] = {}
        if self.tp.size == 1:
            per_hash.update(zip(unique, local.split([item.length for item in items]), strict=True))
        else:
            # Every rank knows every share's token count from the plan, so the gather needs no size exchange.
            counts = [sum(items[i].length for i in share) for share in shares]
            padded = torch.zeros((max(counts), self.hidden), dtype=self.dtype, device=self.device)
            padded[: local.shape[0]] = local
            gathered = self.tp.all_gather(padded, dim=0).split(max(counts))
            for share, rows, count in zip(shares, gathered, counts, strict=True):
                split = rows[:count].split([items[i].length for i in share])
                per_hash.update((items[i].hash, t) for i, t in zip(share, split, strict=True))
        out = []
        for job in jobs:
            parts = [per_hash[item.hash] for item in job.items]
            entry = parts[0] if len(parts) == 1 else torch.cat(parts)
            if entry.shape[0] != sum(item.length for item in job.items):
                raise RuntimeError(f"ViT returned {entry.shape[0]} tokens for key {job.key.hex()[:16]}")
            out.append(entry)
        return out, len(items)


class JobEncoder(VisionEncoder):
    """A model worker's encoder: the plan's jobs encoded and put into its embedding store."""

    def __init__(self, model: VLModel, store: EmbeddingStore, tp: TPGroup, pixel_source: PixelSource,
                 counters: RunnerCounters, model_dir: str, merge: int, embed_width: int, vit_max_patches: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(model.encode, tp, pixel_source, counters, model_dir, merge, embed_width, vit_max_patches,
                         device, dtype)
        self.store = store

    def run(self, jobs: list[EncodeJob]) -> int:
        """Encode every distinct image of the step's jobs and store the jobs' entries; the number of images."""
        entries, images = self.entries(jobs)
        for job, entry in zip(jobs, entries, strict=True):
            self.store.put(job.key, entry, job.transient)
        return images


def import_entries(imports: list[EmbeddingImport], store: EmbeddingStore, device: torch.device,
                   dtype: torch.dtype, landings: LandingReader) -> int:
    """Copy the entries encoder workers landed (a plan's ``mm_import``) into the store, in order; the number copied.
    A landing segment is mapped only for the copy, a CUDA pool range read in place (device to device, or peer to
    peer); the scheduler unlinks or releases either once the step is over."""
    for imp in imports:
        rows = landings.rows(imp.embeddings)
        if rows.dim() != 2 or rows.shape[0] != imp.rows:
            raise RuntimeError(f"landed entry {imp.key.hex()[:16]} is {tuple(rows.shape)}, the plan says {imp.rows} rows")
        # A copy (also on the CPU, and on the pool's own GPU): the store must keep neither the segment's pages mapped
        # nor the pool's range, which the encoder hands out again once the scheduler releases it.
        store.put(imp.key, rows.to(device=device, dtype=dtype, copy=True), imp.transient)
    return len(imports)


def _frame_layout(model: str, merge: int) -> FrameLayout | None:
    """The numbers that make a uint8 frame into rows. A tokenizer writes frames only where its own check found them
    the processor's bits, so the worker needs the numbers, not the check."""
    try:
        ip = AutoImageProcessor.from_pretrained(model)
        own = family_package(load_spec(model).family).frame_layout  # a family with its own image side
        return own(ip, merge) if own is not None else layout_of(ip, merge)
    except Exception as exc:  # a checkpoint without an image processor: its tokenizers write no frames either
        log.info("no uint8 frame layout for %s: %s", model, exc)
        return None
