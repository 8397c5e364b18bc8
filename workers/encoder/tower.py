"""An encoder worker's vision side: the family's tower built and loaded alone (no language model), and a batch of
``EncodeRequest``s turned into landing segments.

The encode itself is the model worker's (``VisionEncoder``, runner/encoder.py): the same pixel rows, ViT calls of at
most ``--vit-max-patches`` and the same entry layout (DeepStack levels side by side), so an entry computed here is
the one a model worker would have stored. What this module adds is what a separate process needs: pixels checked
against their grid before the ViT sees them (a bad segment fails its request with a 400, not the worker), a batch
retried job by job when one of its jobs fails, each entry landed where a model rank reads it (a range of the
encoder's CUDA landing pool when it has one with room, cuda_landing.py, else a segment of the launch of its own),
and, for a shared encoder, its recent entries (recent.py) answering one replica with what another asked for.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ipc.encode import EncodeDone, EncodeFailed, EncodeRequest
from ipc.landing import NixlLanding, ShmLanding
from ipc.shm import ShmError, ShmFullError, ShmSegment, segment_name
from ipc.steps import EncodeItem, EncodeJob
from workers.encoder.pool import LandingPool
from workers.encoder.recent import RecentEntries
from workers.encoder.warmup import warm_encoder_tower
from workers.engine.config import EngineConfig
from workers.engine.layers.linear import TPGroup
from workers.engine.models import family as family_package
from workers.engine.models.load import load_vision
from workers.engine.prompt.pixel_frames import FrameLayout
from workers.engine.runner.encoder import RunnerCounters, VisionEncoder

log = logging.getLogger("glimpse.encoder")


class BadPixels(ValueError):
    """An image's segment does not hold pixels of its grid: the request's fault (400), not the encoder's."""


@dataclass
class PixelCheck:
    """The encoder's pixel source: maps an image's segment, checks the tensor against the image's grid (a frame of
    the grid's size, or one row per patch of the tower's width), and returns the view (which keeps the mapping
    alive only until the batch is copied into patch rows)."""

    patch_dim: int
    layout: FrameLayout | None = None  # set once the encoder knows the processor's
    reads: int = 0
    bytes_read: int = 0

    def __call__(self, item: EncodeItem) -> torch.Tensor:
        ref = item.pixels
        if ref is None:
            raise BadPixels(f"image {item.hash.hex()[:16]} has no shared-memory pixels")
        try:
            with ShmSegment.attach(ref) as seg:
                pixels = seg.tensor(ref)
        except ShmError as exc:
            raise BadPixels(f"image {item.hash.hex()[:16]}: {exc}") from None
        t, h, w = item.grid
        if pixels.dtype == torch.uint8:
            want = self.layout.shape(item.grid) if self.layout is not None and t == 1 else None
            if want is None or tuple(pixels.shape) != want:
                raise BadPixels(f"image {item.hash.hex()[:16]}: a {tuple(pixels.shape)} frame for grid {item.grid}")
        elif pixels.dim() != 2 or pixels.shape[0] != t * h * w or pixels.shape[1] != self.patch_dim:
            raise BadPixels(
                f"image {item.hash.hex()[:16]}: pixels {tuple(pixels.shape)} for grid {item.grid} "
                f"({t * h * w} rows of {self.patch_dim} expected)"
            )
        if not pixels.dtype.is_floating_point and pixels.dtype != torch.uint8:
            raise BadPixels(f"image {item.hash.hex()[:16]}: pixels of dtype {pixels.dtype}")
        self.reads += 1
        self.bytes_read += ref.nbytes
        return pixels


Answer = EncodeDone | EncodeFailed


@dataclass
class EncoderTower:
    """The tower of ``engine``'s checkpoint on ``device``, and the encode of a batch of requests into ranges of
    ``pool`` (CUDA) or landing segments named after the launch."""

    engine: EngineConfig
    launch_id: str
    index: int
    device: torch.device
    counters: RunnerCounters = field(default_factory=lambda: RunnerCounters(keep_per_step=False))
    jobs: int = 0
    failed: int = 0
    landing_bytes: int = 0
    pool: LandingPool | None = None  # set by the process once the tower is loaded (None: shared memory only)
    cuda_landings: int = 0
    nixl_landings: int = 0
    shm_landings: int = 0
    recent: RecentEntries | None = None  # a shared encoder's last entries (--encoder-cache-mb; None: none kept)
    reused: int = 0  # requests answered with an entry computed for another (earlier, or the same batch's)
    fused: bool = False  # CUDA: whether the tower runs its fused kernels (set by the start-up warm-up)

    def __post_init__(self) -> None:
        cfg = self.engine
        spec = cfg.model_spec()
        fam = family_package(spec.family)
        if fam.build_tower is None:
            raise ValueError(f"{spec.architecture} cannot run split encoder workers (its family has no build_tower)")
        self.dtype = cfg.torch_dtype()
        tower: Any = fam.build_tower(spec, self.dtype, self.device, cfg.attn_backend)  # every family's has call_plans
        tower.call_plans.resize(int(cfg.vit_plan_cache_mb * 2**20))
        self.tower = load_vision(tower, cfg.model, load_format=cfg.load_format, seed=cfg.seed)
        self.pixels = PixelCheck(spec.patch_dim)
        self.vision = VisionEncoder(self.tower, TPGroup(), self.pixels, self.counters, cfg.model,
                                    spec.spatial_merge_size, spec.embed_width, cfg.vit_max_patches, self.device,
                                    self.dtype)
        self.pixels.layout = self.vision.frame_layout
        self._names = itertools.count()
        # CUDA: the fused kernels on and every first use paid before the worker says it is ready (warmup.py)
        self.fused = self.device.type == "cuda" and warm_encoder_tower(self.tower, spec, cfg, self.dtype, self.device)

    @torch.inference_mode()
    def run(self, requests: list[EncodeRequest]) -> list[Answer]:
        """Each request's answer, in order. An entry the encoder holds (``recent``: a shared encoder's) lands without
        a ViT run; the others run as one set of ViT calls, one job per distinct key (two replicas asking for one
        image in one batch share it). If that fails, each request runs alone, so one bad image fails only its own
        request. Every request gets a landing of its own, which its scheduler owns."""
        held: dict[bytes, torch.Tensor] = {}
        if self.recent is not None:
            for r in requests:
                hit = self.recent.get(r.key) if r.key not in held else None
                if hit is not None:
                    held[r.key] = hit.to(self.device)
        todo: dict[bytes, EncodeRequest] = {}  # the first asker of each key not held
        for r in requests:
            if r.key not in held and r.key not in todo:
                todo[r.key] = r
        if todo:
            jobs = [EncodeJob(r.key, r.items) for r in todo.values()]
            try:
                entries, _ = self.vision.entries(jobs)
            except Exception as exc:
                if len(requests) == 1:
                    return [self._failed(requests[0], exc)]
                return [answer for r in requests for answer in self.run([r])]
            for job, entry in zip(jobs, entries, strict=True):
                held[job.key] = entry
                if self.recent is not None:
                    self.recent.put(job.key, entry)
        self.reused += len(requests) - len(todo)
        return [self._land(r, held[r.key]) for r in requests]

    def _land(self, request: EncodeRequest, entry: torch.Tensor) -> Answer:
        if self.pool is not None and (in_pool := self.pool.land(entry)) is not None:
            self.jobs += 1
            if isinstance(in_pool, NixlLanding):
                self.nixl_landings += 1
            else:
                self.cuda_landings += 1
            self.landing_bytes += in_pool.nbytes
            return EncodeDone(self.index, request.key, int(entry.shape[0]), in_pool)
        # No pool, or no range long enough now: this entry goes through shared memory.
        name = segment_name(self.launch_id, f"emb-{request.key.hex()}-e{self.index}x{next(self._names):x}")
        try:
            seg, ref = ShmSegment.create_from_tensor(name, entry.to("cpu").contiguous())
        except ShmFullError as exc:
            self.failed += 1
            return EncodeFailed(self.index, request.key, 503, f"no room in shared memory for the embeddings: {exc}")
        seg.close()
        self.jobs += 1
        self.shm_landings += 1
        self.landing_bytes += ref.nbytes
        landing = ShmLanding(ref.name, ref.nbytes, ref.dtype, ref.shape)
        return EncodeDone(self.index, request.key, int(entry.shape[0]), landing)

    def _failed(self, request: EncodeRequest, exc: Exception) -> EncodeFailed:
        """The answer for a request whose encode raised ``exc``."""
        self.failed += 1
        if isinstance(exc, BadPixels):
            log.warning("job %s refused: %s", request.key.hex()[:16], exc)
            return EncodeFailed(self.index, request.key, 400, f"the image cannot be encoded: {exc}")
        log.error("job %s failed", request.key.hex()[:16], exc_info=exc)
        return EncodeFailed(self.index, request.key, 500, f"the encoder failed: {type(exc).__name__}: {exc}")
