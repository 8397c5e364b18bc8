"""Video decoding with PyAV (FFmpeg): a cheap probe, then only the sampled frames.

``probe`` demuxes the container without decoding anything: it reads every video packet's presentation
timestamp and keyframe flag, which gives the frame count, the frame rate and, for each frame index, the
timestamp to seek to. ``decode_frames`` then decodes only what the sampled frames need: it seeks to the
keyframe at or before a sampled frame whenever a keyframe lies between the decoder's position and that
frame (the frames in between hold nothing sampled), and otherwise decodes forward. Only sampled frames are
converted to RGB. The pixels are exactly those of decoding every frame in order (FFmpeg decodes a GOP the
same way from its keyframe), which is what transformers' PyAV reader does.

Why PyAV and not torchcodec: PyAV's wheels carry their own FFmpeg, so serving needs no system library and
the Docker image no extra layer; torchcodec loads the system's FFmpeg 4-7 shared libraries (none on these
machines) and each release is built for one torch version, which two pinned torch versions (2.11 on the
GPU host, 2.14 here) cannot share.
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

# FFmpeg's demuxer names for the containers served: MP4 and QuickTime share one demuxer, WebM and Matroska
# another. Anything else is refused before a decoder sees it.
FORMATS: dict[str, str] = {"mov,mp4,m4a,3gp,3g2,mj2": "mp4/mov", "matroska,webm": "webm/mkv"}

Source = bytes | str | Path

# FFmpeg's own log lines would repeat, unstructured, what VideoError already reports for a bad client file.
av.logging.set_level(av.logging.PANIC)


class VideoError(ValueError):
    """The bytes are not a video we can decode (unknown container, no video stream, corrupt, truncated)."""


@dataclass(frozen=True)
class VideoProbe:
    """What a video is, from its packets alone (nothing decoded)."""

    container: str  # one of FORMATS' values
    codec: str
    width: int
    height: int
    fps: float  # the stream's average frame rate, as transformers' PyAV reader reports it
    pts: tuple[int, ...]  # presentation timestamp of frame i (stream time base), in display order
    keyframes: tuple[int, ...]  # presentation timestamps of the keyframes, sorted

    @property
    def total_frames(self) -> int:
        return len(self.pts)

    @property
    def duration(self) -> float:
        """Seconds, counted in frames as transformers does (frames / fps)."""
        return self.total_frames / self.fps if self.fps else 0.0


def _open(source: Source) -> av.container.InputContainer:
    target = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    try:
        return av.open(target, mode="r", metadata_errors="ignore")
    except (av.FFmpegError, OSError, UnicodeDecodeError) as exc:
        raise VideoError(f"not a readable video file ({type(exc).__name__})") from None


def probe(source: Source) -> VideoProbe:
    """Read a video's container and packets (not its pixels). Raises VideoError for anything unusable."""
    with _open(source) as container:
        kind = FORMATS.get(container.format.name)
        if kind is None:
            raise VideoError(f"unsupported container {container.format.name!r} (mp4, mov, webm and mkv are)")
        if not container.streams.video:
            raise VideoError("the file has no video stream")
        stream = container.streams.video[0]
        ctx = stream.codec_context
        if not ctx.width or not ctx.height:
            raise VideoError("the video stream has no frame size")
        rate = stream.average_rate or stream.guessed_rate
        pts: list[int] = []
        keys: list[int] = []
        try:
            for packet in container.demux(stream):
                if packet.size == 0 or packet.pts is None:  # the demuxer's end marker, or no timestamp
                    continue
                pts.append(packet.pts)
                if packet.is_keyframe:
                    keys.append(packet.pts)
        except av.FFmpegError as exc:
            raise VideoError(f"the video is corrupt or truncated ({type(exc).__name__})") from None
        if not pts:
            raise VideoError("the video has no frames")
        if not keys:
            raise VideoError("the video has no keyframe")
        fps = float(rate) if rate else 0.0
        if fps <= 0:
            raise VideoError("the video has no frame rate")
        return VideoProbe(kind, ctx.name, ctx.width, ctx.height, fps, tuple(sorted(pts)), tuple(sorted(keys)))


def decode_frames(source: Source, info: VideoProbe, indices: list[int]) -> np.ndarray:
    """The frames at ``indices`` (ascending frame numbers of ``info``) as uint8 RGB [n, H, W, 3]."""
    return np.stack(list(iter_frames(source, info, indices)))


def iter_frames(source: Source, info: VideoProbe, indices: list[int]) -> Iterator[np.ndarray]:
    """The frames at ``indices`` one by one, as uint8 RGB [H, W, 3]: a caller that processes them as they
    come holds a few frames at a time, not the whole sampled video."""
    if not indices:
        raise ValueError("no frames to decode")
    if any(b <= a for a, b in zip(indices, indices[1:])) or indices[0] < 0 or indices[-1] >= info.total_frames:
        raise ValueError(f"frame indices must ascend within [0, {info.total_frames})")
    shape: tuple[int, ...] | None = None
    with _open(source) as container:
        stream = container.streams.video[0]
        # Slice threads only: frame threads (AUTO/FRAME) deadlock in avcodec_free_context when a decode stops before
        # the stream ends with torchvision imported (PyAV issues 1849/1861), which sampling frames always does.
        stream.thread_type = "SLICE"
        decoded = None
        position: int | None = None  # pts of the last frame the decoder gave us
        for index in indices:
            target = info.pts[index]
            key = info.keyframes[max(0, bisect.bisect_right(info.keyframes, target) - 1)]
            try:
                if decoded is None or position is None or key > position:
                    # A keyframe lies between here and the target: start from it, skip what is in between.
                    container.seek(key, stream=stream, backward=True, any_frame=False)
                    decoded = container.decode(stream)
                frame = _advance(decoded, target)
                if frame is None:
                    raise VideoError("the video is truncated: a sampled frame could not be decoded")
                position = frame.pts
                rgb = frame.to_ndarray(format="rgb24")
            except av.FFmpegError as exc:
                raise VideoError(f"the video is corrupt ({type(exc).__name__})") from None
            if shape is not None and rgb.shape != shape:
                raise VideoError("the video changes frame size midway")
            shape = rgb.shape
            yield rgb


def _advance(decoded: object, target: int) -> av.VideoFrame | None:
    """Decode forward to the frame shown at ``target``; None if the stream ends first."""
    for frame in decoded:  # type: ignore[attr-defined]
        if frame.pts is None:
            raise VideoError("a decoded frame has no timestamp")
        if frame.pts > target:
            # The seek landed past the frame (a container index that disagrees with its packets).
            raise VideoError("the video's index does not match its frames")
        if frame.pts == target:
            return frame
    return None
