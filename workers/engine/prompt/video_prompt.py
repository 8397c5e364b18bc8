"""A video as frame groups: sampling, layout in the prompt, identity and pixels of each group.

A video of F sampled frames becomes G = ceil(F / temporal_patch) frame groups. One group (temporal_patch
frames, one t-slice of the video's patch grid) is one media item with grid (1, h, w), its own span in the
prompt and its own hash, so it is encoded, cached and split across prefill chunks exactly like an image.
Both vision towers attend and rotate within a frame only, so encoding the groups one by one gives the rows
of encoding the whole (G, h, w) video at once.

Everything the video processor decides is left to transformers' own code, so the result follows each
family's processor whatever its version: which frames (``sample_frames``), the frame size (its ``resize``,
run on a meta tensor: only the shape is computed), and the pixels (the same resize, rescale/normalize and
patchify calls its ``_preprocess`` makes), here a few groups at a time instead of the whole video, which
gives the same rows because each of those steps works frame by frame (patchify: group by group).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
from transformers.image_utils import SizeDict
from transformers.video_utils import VideoMetadata

from workers.engine.models.base import ModelFamily
from workers.engine.models.model_spec import ModelSpec, VideoTiming
from workers.engine.prompt.video_decode import VideoProbe, iter_frames, probe

Grid = tuple[int, int, int]
DEFAULT_FPS = 2.0  # frames sampled per second when the checkpoint's video processor names no rate (qwen-vl-utils' default)


@dataclass(frozen=True)
class GroupInfo:
    """One frame group as a prompt sees it (the ImageMeta shape, so spans are built the same way)."""

    hash: bytes
    grid: Grid
    num_tokens: int


@dataclass(frozen=True)
class VideoMeta:
    """What a prompt needs of one video: no pixels (a resent video builds its prompt without decoding)."""

    hash: bytes  # the video's content hash, framed with the sampling settings
    groups: tuple[GroupInfo, ...]
    text: str  # replaces the video's placeholder token: the family's layout, one video pad per group
    frame_t: tuple[int, ...]  # each group's temporal M-RoPE offset from the video's start

    @property
    def num_tokens(self) -> int:
        return sum(g.num_tokens for g in self.groups)


@dataclass(frozen=True)
class VideoPlan:
    """A video's layout and what decoding it takes: which frames, at what size."""

    meta: VideoMeta
    indices: tuple[int, ...]  # frame numbers to decode, ascending
    size: tuple[int, int]  # (height, width) every frame is resized to
    probe: VideoProbe


@dataclass(frozen=True)
class VideoSettings:
    """A request's sampling and sizing of its videos (``mm_processor_kwargs``; None: the checkpoint's)."""

    fps: float | None = None  # frames sampled per second
    num_frames: int | None = None  # frames sampled in all (rounded to the temporal patch by the processor)
    sample: bool = True  # False: every frame, as a processor with do_sample_frames off takes them
    size: dict[str, int] | None = None  # the pixel range of a frame (pixel_range.py)

    def digest(self) -> bytes:
        """What sets these apart in a video's identity (empty: the checkpoint's settings)."""
        if self == VideoSettings():
            return b""
        return json.dumps([self.fps, self.num_frames, self.sample, self.size], sort_keys=True).encode()


DEFAULT_SETTINGS = VideoSettings()


def content_digest(raw: bytes) -> bytes:
    """The encoded file's own digest (16 bytes): what a client's uuid names, whatever settings a request uses."""
    return blake3.blake3(raw).digest(16)


def group_hash(video_hash: bytes, index: int) -> bytes:
    """Group ``index`` of a video: its identity in the embedding cache, the prefix cache and shm (16 bytes)."""
    h = blake3.blake3(b"glimpse-video-group-v1")
    h.update(video_hash)
    h.update(index.to_bytes(4, "little"))
    return h.digest(16)


class VideoProcessor:
    """The checkpoint's video processor, driven a few frame groups at a time."""

    def __init__(self, hf: Any, spec: ModelSpec, family: ModelFamily, tokens: tuple[str, str, str]) -> None:
        if family.video_layout is None:
            raise ValueError(f"the {family.name} family takes no video")
        self.hf, self.spec, self.family, self.tokens = hf, spec, family, tokens
        self.layout = family.video_layout
        # Frames are always sampled (a video's every frame would be thousands of groups); at the processor's
        # own rate where its config names one (Qwen3-VL: 2), else at qwen-vl-utils' 2 per second.
        self.fps = float(hf.fps) if getattr(hf, "fps", None) else DEFAULT_FPS
        self.temporal = int(hf.temporal_patch_size)
        self.patch = int(hf.patch_size)
        self.merge = int(hf.merge_size)
        self.resize_kwargs = {
            "size": hf.size,
            "resample": hf.resample,
            "factor": self.patch * self.merge,
            "temporal_factor": self.temporal,
            "cap_pixels_per_frame": bool(getattr(hf, "cap_pixels_per_frame", False)),
        }
        self.mean = tuple(hf.image_mean) if isinstance(hf.image_mean, list) else hf.image_mean
        self.std = tuple(hf.image_std) if isinstance(hf.image_std, list) else hf.image_std
        settings = json.dumps({"processor": hf.to_dict(), "fps": self.fps}, sort_keys=True, default=str)
        self._settings_digest = blake3.blake3(settings.encode()).digest(16)

    def video_hash(self, digest: bytes, settings: VideoSettings = DEFAULT_SETTINGS) -> bytes:
        """Hash of the encoded file (its `content_digest`), framed with everything that decides its frames' pixels:
        the checkpoint's processor settings and the request's."""
        h = blake3.blake3(b"glimpse-video-v2")
        h.update(self._settings_digest)
        h.update(settings.digest())
        h.update(digest)
        return h.digest(16)

    def sample(self, metadata: VideoMetadata, settings: VideoSettings) -> list[int]:
        """The frames to decode under ``settings``, by the video processor's own ``sample_frames``; ValueError where it
        refuses them (e.g. more frames than the video has)."""
        if not settings.sample:
            return list(range(metadata.total_num_frames))
        try:
            if settings.num_frames is not None:
                picked = self.hf.sample_frames(metadata, num_frames=settings.num_frames)
            else:
                picked = self.hf.sample_frames(metadata, fps=settings.fps if settings.fps is not None else self.fps)
        except ZeroDivisionError:  # Qwen2-VL's: num_frames rounded down to no frame
            raise ValueError("num_frames rounds to no frame group") from None
        return [int(i) for i in picked]

    def plan(self, info: VideoProbe, video_hash: bytes, settings: VideoSettings = DEFAULT_SETTINGS) -> VideoPlan:
        """Sample, size and lay out a probed video under ``settings`` (nothing decoded)."""
        metadata = VideoMetadata(
            total_num_frames=info.total_frames,
            fps=info.fps,
            width=info.width,
            height=info.height,
            duration=info.duration,
            video_backend="pyav",
        )
        indices = tuple(self.sample(metadata, settings))
        if not indices:
            raise ValueError("the video is too short to sample")
        shape = (1, len(indices), 3, info.height, info.width)
        meta_video = torch.empty(shape, dtype=torch.uint8, device="meta")
        resize = self.resize_kwargs if settings.size is None else {**self.resize_kwargs, "size": SizeDict(**settings.size)}
        height, width = (int(v) for v in self.hf.resize(videos=meta_video, **resize).shape[-2:])
        grid = (1, height // self.patch, width // self.patch)
        timing = VideoTiming(indices, info.fps, info.total_frames, self.temporal)
        text, frame_t = self.layout(self.spec, timing, self.tokens)
        tokens = grid[1] * grid[2] // (self.merge * self.merge)
        groups = tuple(GroupInfo(group_hash(video_hash, g), grid, tokens) for g in range(timing.num_groups))
        if len(frame_t) != len(groups):
            raise RuntimeError(f"layout gave {len(frame_t)} groups, sampling {len(groups)}")
        return VideoPlan(VideoMeta(video_hash, groups, text, tuple(frame_t)), indices, (height, width), info)

    def group_pixels(
        self, frames: Iterable[np.ndarray], plan: VideoPlan, groups_per_batch: int = 4
    ) -> Iterator[torch.Tensor]:
        """pixel_values of each group in order ([h * w, patch_dim] float32), from the sampled frames (uint8
        RGB [H, W, 3], as decoded) consumed a batch of groups at a time."""
        batch: list[np.ndarray] = []
        per_batch = self.temporal * groups_per_batch
        for frame in frames:
            batch.append(frame)
            if len(batch) == per_batch:
                yield from self._process(batch, plan)
                batch = []
        if batch:
            yield from self._process(batch, plan)

    def _process(self, frames: Sequence[np.ndarray], plan: VideoPlan) -> Iterator[torch.Tensor]:
        hf = self.hf
        video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous().unsqueeze(0)
        height, width = plan.size
        # The call the family's resize ends in, with the size it computed for the whole video.
        base: Any = super(type(hf), hf)
        resized = base.resize(image=video, size=SizeDict(height=height, width=width), resample=hf.resample)
        normalized = hf.rescale_and_normalize(
            resized, hf.do_rescale, hf.rescale_factor, hf.do_normalize, self.mean, self.std
        )
        patches, t, h, w = hf.patchify(
            normalized, patch_size=self.patch, merge_size=self.merge, temporal_patch_size=self.temporal
        )
        rows = patches[0].to(torch.float32)
        yield from (part.contiguous() for part in rows.split(h * w))


def read_video(processor: VideoProcessor, source: bytes | str | Path) -> tuple[VideoMeta, list[torch.Tensor]]:
    """A whole video in one call (the offline Engine): its layout and every group's pixel_values."""
    raw = source if isinstance(source, bytes) else Path(source).read_bytes()
    plan = processor.plan(probe(raw), processor.video_hash(content_digest(raw)))
    pixels = list(processor.group_pixels(iter_frames(raw, plan.probe, list(plan.indices)), plan))
    return plan.meta, pixels


def videos_in(messages: Sequence[dict[str, Any]]) -> list[bytes | str | Path]:
    """The sources of ``{"type": "video", "video": path or bytes}`` parts, in prompt order."""
    found: list[bytes | str | Path] = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "video":
                source = part.get("video")
                if not isinstance(source, bytes | str | Path):
                    raise TypeError("offline video parts need a file path or the file's bytes under 'video'")
                found.append(source)
    return found
