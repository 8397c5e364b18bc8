"""A request's settings for its media's processing: vLLM's ``mm_processor_kwargs`` (chat and completions) and OpenAI's
per-image ``image_url.detail``.

The keys are transformers' processor arguments, as vLLM and SGLang pass them on:

- ``min_pixels`` / ``max_pixels`` (Qwen families): the pixel range an image, or a video's every frame, is resized into
  (transformers' ``size={"shortest_edge": min_pixels, "longest_edge": max_pixels}``); unset, the checkpoint's.
  Neither may pass the server's ``--max-image-pixels``.
- ``fps`` / ``num_frames`` (videos): sample this many frames per second, or this many frames in all (rounded to the
  temporal patch as transformers does); one or the other. Unset: the checkpoint's rate, else 2 per second.
- ``do_sample_frames`` (videos): false takes every frame, as a Qwen2.5-VL checkpoint's own processor does (held to
  ``--max-video-frames`` like any sampling); true (or unset) samples as above.
- ``max_soft_tokens`` (Gemma 4): each image's budget of soft tokens (70, 140, 280, 560 or 1120, default the checkpoint
  processor's); an image part's ``detail`` overrides it for that image: "low" is the smallest budget, "high" the
  largest, "auto" (or none) the request's. Families without budgets keep OpenAI's meaning of "low" (the image scaled
  down to 512 px on its longer side before the processor sees it).

Every setting that changes pixels or grids is part of the media's identity (its shm segment, GPU embedding and prefix
cache keys): the same bytes under other settings are another image. A setting equal to the checkpoint's default keeps
the plain identity, so naming the default shares the caches of requests that left it out. A key the checkpoint's
processor does not take, and any value it would refuse, is a 400 naming ``mm_processor_kwargs.<key>``: never ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workers.common.errors import BadRequest
from workers.tokenizer.requests.sampling import range_error, unsupported

FIELD = "mm_processor_kwargs"
BUDGET = "max_soft_tokens"
PIXELS = ("min_pixels", "max_pixels")
VIDEO = ("fps", "num_frames", "do_sample_frames")


@dataclass(frozen=True)
class MediaSettings:
    """One request's processing settings (None: the checkpoint's)."""

    budget: int | None = None  # Gemma 4's max_soft_tokens
    min_pixels: int | None = None
    max_pixels: int | None = None
    fps: float | None = None
    num_frames: int | None = None
    do_sample_frames: bool | None = None

    @property
    def pixels(self) -> tuple[int | None, int | None]:
        return self.min_pixels, self.max_pixels


DEFAULT = MediaSettings()


def _param(key: str) -> str:
    return f"{FIELD}.{key}"


def _integer(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise range_error(_param(key), value, f"an integer between {low} and {high}")
    return value


def media_settings(
    kwargs: Mapping[str, Any] | None, budgets: Sequence[int], *, video: bool = True, pixel_cap: int = 1 << 31,
) -> MediaSettings:
    """The settings ``mm_processor_kwargs`` asks for, checked for a family whose images take token ``budgets`` (empty:
    none; a family with budgets takes no pixel range), whose checkpoint takes video when ``video``, on a server whose
    images may have ``pixel_cap`` pixels. Raises BadRequest naming the key at fault."""
    kwargs = kwargs or {}
    for key in kwargs:
        if key == BUDGET and not budgets:
            raise unsupported(_param(key), "this model's images take no token budget")
        if key in PIXELS and budgets:
            raise unsupported(_param(key), f"this model's images take a token budget ('{_param(BUDGET)}') instead")
        if key in VIDEO and not video:
            raise unsupported(_param(key), "this model takes no video")
        if key not in (BUDGET, *PIXELS, *VIDEO):
            raise unsupported(_param(key), "this server's media processing takes no such setting")
    # A key sent as null is refused like any other value it cannot take: only leaving it out means the default.
    budget = kwargs.get(BUDGET)
    if BUDGET in kwargs and (isinstance(budget, bool) or not isinstance(budget, int) or budget not in budgets):
        param = _param(BUDGET)
        allowed = ", ".join(str(b) for b in budgets)
        raise BadRequest(
            f"Invalid value for '{param}': expected one of {allowed}, but got {budget!r} instead.",
            param=param,
            code="invalid_value",
        )
    low = _integer("min_pixels", kwargs["min_pixels"], 1, pixel_cap) if "min_pixels" in kwargs else None
    # Both ends held to the server's image cap: a request may not make a tokenizer process (or upscale to) a larger
    # frame than it would accept as input.
    high = _integer("max_pixels", kwargs["max_pixels"], 1, pixel_cap) if "max_pixels" in kwargs else None
    if low is not None and high is not None and low > high:
        raise range_error(_param("max_pixels"), high, f">= min_pixels ({low})")
    fps = kwargs.get("fps")
    if "fps" in kwargs and (fps is None or isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps <= 1000
                            or not math.isfinite(fps)):
        raise range_error(_param("fps"), fps, "a number above 0 and at most 1000")
    frames = _integer("num_frames", kwargs["num_frames"], 1, 1 << 20) if "num_frames" in kwargs else None
    if fps is not None and frames is not None:  # transformers' sample_frames refuses both
        raise BadRequest(f"'{_param('num_frames')}' and '{_param('fps')}' exclude each other: send one.",
                         param=_param("num_frames"), code="invalid_value")
    sample = kwargs.get("do_sample_frames")
    if "do_sample_frames" in kwargs and not isinstance(sample, bool):
        raise range_error(_param("do_sample_frames"), sample, "true or false")
    if sample is False and (fps is not None or frames is not None):  # sampling settings that would go unused
        key = "fps" if fps is not None else "num_frames"
        raise BadRequest(f"'{_param(key)}' samples frames, which 'do_sample_frames': false turns off.",
                         param=_param(key), code="invalid_value")
    return MediaSettings(budget, low, high, None if fps is None else float(fps), frames, sample)


def request_budget(kwargs: Mapping[str, Any] | None, budgets: Sequence[int], video: bool = False) -> int | None:
    """The image token budget ``mm_processor_kwargs`` asks for (None: the checkpoint's default); every other key is
    checked as `media_settings` does (video keys refused unless ``video``)."""
    return media_settings(kwargs, budgets, video=video).budget


def image_options(detail: str | None, budget: int | None, budgets: Sequence[int]) -> tuple[bool, int | None]:
    """(scaled down before the processor, token budget) of one image with this ``detail``, in a request whose budget
    is ``budget`` (`request_budget`), for a family with these ``budgets`` (empty: none)."""
    if not budgets:
        return detail == "low", None
    if detail == "low":
        return False, min(budgets)
    if detail == "high":
        return False, max(budgets)
    return False, budget
