"""A request's ``mm_processor_kwargs`` (requests/mm_kwargs.py) as the checkpoint's processors take them: the pixel range
of its images and of its videos' frames (transformers' ``size``), and its videos' sampling."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from workers.common.errors import BadRequest
from workers.engine.prompt.pixel_range import size_for
from workers.engine.prompt.processor import MMProcessor
from workers.engine.prompt.video_prompt import DEFAULT_SETTINGS, VideoSettings
from workers.tokenizer.requests.mm_kwargs import FIELD, MediaSettings
from workers.tokenizer.requests.sampling import unsupported


@dataclass(frozen=True)
class ProcessorSettings:
    image_size: dict[str, int] | None = None  # None: the image processor's own range
    video: VideoSettings = DEFAULT_SETTINGS
    blame: str = ""  # the mm_processor_kwargs key a video's sampling failure is the fault of ("": the video's)
    video_refuses: str = ""  # a key the checkpoint's video processor does not take, refused for requests with video

    def check_videos(self, has_videos: bool) -> None:
        if has_videos and self.video_refuses:
            why = "this model's video processor sizes a video as a whole and takes no pixel range (only its images do)"
            raise unsupported(f"{FIELD}.{self.video_refuses}", why)


def processor_settings(settings: MediaSettings, processor: MMProcessor) -> ProcessorSettings:
    """``settings`` for ``processor``'s image and video processors; a 400 naming the key where the pixel range is empty
    once the checkpoint's defaults fill in what the request left out."""
    image_size = _size(processor.image_processor, settings) if processor.images is None else None
    if processor.video is None:
        return ProcessorSettings(image_size)
    # Qwen2-VL's video processor takes min/max_pixels per frame; Qwen3-VL's bounds the whole video's volume through
    # its ``size`` and ignores them, so a video there would not honour them: refused (`check_videos`), as transformers'
    # processor would leave them unused.
    standardize = getattr(processor.video.hf, "_standardize_kwargs", None)
    per_frame = standardize is not None and "min_pixels" in inspect.signature(standardize).parameters
    refuses = "" if per_frame or settings.pixels == (None, None) else (
        "min_pixels" if settings.min_pixels is not None else "max_pixels"
    )
    video = VideoSettings(
        fps=None if settings.fps == processor.video.fps else settings.fps,  # the default rate: the plain identity
        num_frames=settings.num_frames,
        sample=settings.do_sample_frames is not False,
        size=_size(processor.video.hf, settings) if per_frame else None,
    )
    blame = f"{FIELD}.fps" if settings.fps is not None else f"{FIELD}.num_frames" if settings.num_frames else ""
    return ProcessorSettings(image_size, video, blame, refuses)


def _size(hf: object, settings: MediaSettings) -> dict[str, int] | None:
    try:
        return size_for(hf, settings.pixels)
    except ValueError as exc:
        key = "min_pixels" if settings.min_pixels is not None else "max_pixels"
        raise BadRequest(f"Invalid '{FIELD}.{key}': {exc}.", param=f"{FIELD}.{key}", code="invalid_value") from None
