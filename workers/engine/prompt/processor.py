"""Prompt building for the Qwen-style VLM families: chat template, image processing, content hashing and
placeholder expansion (M-RoPE positions are left to the model workers, which derive them from the spans). Runs where the tokenizer runs (a tokenizer process when serving,
the caller's process for the offline Engine), never on an event loop.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import blake3
import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor

from workers.engine.models import family as family_package, load_spec
from workers.engine.models.base import ModelSpec, item_spans
from workers.engine.prompt.pixel_frames import (
    FrameLayout,
    FrameResizer,
    frame_layout,
    frame_resizer,
    normalised_frames,
    patch_rows_into,
)
from workers.engine.prompt.video_prompt import VideoMeta, VideoProcessor

# Pad values live above any real vocabulary, so an image span can never look like text, and two
# different images never look like the same prefix. They fit in int32.
PAD_BASE = 1 << 30


def pad_value(image_hash: bytes) -> int:
    return PAD_BASE + int.from_bytes(image_hash[:4], "little") % PAD_BASE


@dataclass(frozen=True)
class ProcessedImage:
    hash: bytes
    grid: tuple[int, int, int]  # (t, h, w) in patches
    num_tokens: int
    # [t * h * w, channels * temporal_patch * patch**2] float32; with ``frame`` set, the normalised [channels, H, W]
    # float32 image the rows are cut from (`write_rows` lays them out), or with ``uint8`` the [H, W, channels] frame.
    pixel_values: torch.Tensor
    frame: tuple[int, int, int] | None = None  # (patch, merge, temporal patch) of a frame's rows
    # The frame is the resized uint8 image, before rescale and normalise (pixel_frames.py): shm holds it as it is.
    uint8: bool = False

    def write_rows(self, dst: torch.Tensor) -> None:
        """Write what a segment holds of this image into ``dst``: the patch rows ([t * h * w, row], any float
        dtype), or with ``uint8`` the frame itself ([H, W, C] uint8). From a normalised frame, the patchify, the
        temporal repeat and the cast are one strided copy, with no float32 copy of the rows in between: the
        same values, in the same layout, as the processor's own patchify."""
        if self.frame is None or self.uint8:
            dst.copy_(self.pixel_values)
            return
        patch_rows_into(self.pixel_values, dst, *self.frame)


class ImageMeta(Protocol):
    """What a prompt needs to know of an image: no pixels (a tokenizer builds prompts before, or without,
    processing an image whose segment it reuses)."""

    @property
    def hash(self) -> bytes: ...
    @property
    def grid(self) -> tuple[int, int, int]: ...
    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class ImageInfo:
    hash: bytes
    grid: tuple[int, int, int]
    num_tokens: int


# Marks where the client's text goes in the rendered template. The client's text itself never passes through
# the template (only its index does), so nothing a client sends can forge or break a marker.
_SENTINEL = "\x00glimpse\x00"


@dataclass(frozen=True)
class Rendered:
    """A chat rendered by the template, as (text, came from the client) pieces in order."""

    pieces: list[tuple[str, bool]]

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.pieces)


@dataclass(frozen=True)
class ImageSpan:
    hash: bytes
    offset: int
    length: int
    grid: tuple[int, int, int]
    frame: tuple[int, int] | None = None  # a video's frame group: (its index, its temporal M-RoPE offset)


@dataclass(frozen=True)
class Prompt:
    input_ids: list[int]  # image spans hold hash-derived pad values
    mrope_delta: int  # a decoded token at index p sits at position p + mrope_delta on every row
    spans: list[ImageSpan]


def _called(call: dict[str, Any], text: Any) -> dict[str, Any]:
    """An earlier assistant turn's tool call with its client text (name, string arguments) through ``text``."""
    fn = dict(call.get("function") or {})
    if "name" in fn:
        fn["name"] = text(fn["name"])
    if isinstance(fn.get("arguments"), str):
        fn["arguments"] = text(fn["arguments"])
    return {**call, "function": fn}


class MMProcessor:
    """Tokenizer + image processor of one checkpoint."""

    def __init__(self, model_dir: str | Path, spec: ModelSpec | None = None, resize_threads: int = 1) -> None:
        self.info = spec or load_spec(model_dir)
        # > 1: a uint8 frame's resize runs in row strips on the caller and a pool of the others (resize_in_strips).
        self._resize_strips = resize_threads
        self._resize_pool = ThreadPoolExecutor(resize_threads - 1, "resize") if resize_threads > 1 else None
        self.family = family_package(self.info.family)
        self.hf = AutoProcessor.from_pretrained(str(model_dir))
        self.tokenizer = self.hf.tokenizer
        self.image_processor = self.hf.image_processor
        self.merge = int(getattr(self.image_processor, "merge_size", self.info.spatial_merge_size))
        ip = self.image_processor
        self._geometry = (int(getattr(ip, "patch_size", 0)), self.merge, int(getattr(ip, "temporal_patch_size", 1)))
        self._grids: dict[tuple[int, int], tuple[int, int, int] | None] = {}  # image_grid's answers by (width, height)
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.info.image_token_id)
        # Strings the tokenizer would turn into control tokens (special and added tokens alike).
        self._special_strings = tuple(str(t) for t in self.tokenizer.get_added_vocab())
        settings = json.dumps(self.image_processor.to_dict(), sort_keys=True, default=str)
        # Everything that changes the pixels the ViT sees goes into every image's hash.
        self._settings_digest = blake3.blake3(settings.encode()).digest(16)
        self.video: VideoProcessor | None = None  # None: the checkpoint takes no video
        if self.family.video_layout is not None and getattr(self.hf, "video_processor", None) is not None:
            tokens = (
                str(self.tokenizer.convert_ids_to_tokens(self.info.video_token_id)),
                str(self.tokenizer.convert_ids_to_tokens(self.info.vision_start_token_id)),
                str(getattr(self.hf, "vision_end_token", None) or "<|vision_end|>"),
            )
            self.video = VideoProcessor(self.hf.video_processor, self.info, self.family, tokens)

    # ---- images ---------------------------------------------------------------------------------
    def hash_image(self, image: Image.Image) -> bytes:
        """Content hash framed with mode, size and processor settings (16 bytes)."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        h = blake3.blake3(b"glimpse-image-v1")
        h.update(self._settings_digest)
        h.update(f"{rgb.mode}:{rgb.width}x{rgb.height}:uint8".encode())
        h.update(rgb.tobytes())
        return h.digest(16)

    def media_hash(self, raw: bytes) -> bytes:
        """Hash of an encoded media file as received (16 bytes), framed with the processor settings.

        Used when serving: hashing the encoded bytes lets a tokenizer recognise a resent image
        before decoding it. Its own tag keeps it apart from `hash_image`'s pixel hashes.
        """
        h = blake3.blake3(b"glimpse-media-v1")
        h.update(self._settings_digest)
        h.update(raw)
        return h.digest(16)

    def process_image(
        self, image: Image.Image | np.ndarray, image_hash: bytes | None = None, frame: bool = False
    ) -> ProcessedImage:
        """The image's patch rows, as the checkpoint's processor makes them. With ``frame``, what shared memory
        should hold instead: the resized uint8 frame (pixel_frames.py), else the normalised image for
        `ProcessedImage.write_rows` to lay out, for processors whose fast paths give the full path's bits.
        ``image`` may be [H, W, 3] uint8 RGB pixels (`decode_pixels`), which the uint8 frame's resize reads."""
        # Each fast path is checked on the first such call (the offline Engine never asks for one).
        uint8_frames = self.uint8_frames if frame else None
        uint8 = uint8_frames is not None
        framed = frame and not uint8 and self._frames is not None
        resize = self._frame_resizer if uint8 else None
        if isinstance(image, np.ndarray) and (resize is None or image_hash is None):
            image = Image.fromarray(image, "RGB")  # the paths below, and hash_image, read a PIL image
        rgb = image if isinstance(image, np.ndarray) or image.mode == "RGB" else image.convert("RGB")
        if image_hash is None:
            assert isinstance(rgb, Image.Image)
            image_hash = self.hash_image(rgb)
        if resize is not None:
            pixels = resize(rgb).permute(1, 2, 0)  # [H, W, C], the segment's layout (contiguous: one memcpy into shm)
            patch = self._geometry[0]
            t, h, w = 1, pixels.shape[0] // patch, pixels.shape[1] // patch
        else:
            assert isinstance(rgb, Image.Image)
            ip = uint8_frames[1] if uint8_frames is not None else self._frames if framed else self.image_processor
            out = ip(images=[rgb], return_tensors="pt")
            t, h, w = (int(v) for v in out["image_grid_thw"][0].tolist())
            pixels = out["pixel_values"].permute(1, 2, 0) if uint8 else out["pixel_values"].to(torch.float32).contiguous()
        return ProcessedImage(
            hash=image_hash,
            grid=(t, h, w),
            num_tokens=self.tokens_for_grid((t, h, w)),
            pixel_values=pixels,
            frame=self._geometry if uint8 or framed else None,
            uint8=uint8,
        )

    @cached_property
    def uint8_frames(self) -> tuple[FrameLayout, Any] | None:
        """The layout of this processor's images as uint8 frames in shm, and the processor copy that makes them;
        None where its rows would not come out the same bits (then frames are normalised, or rows)."""
        return frame_layout(self.image_processor, self.merge)

    @cached_property
    def _frame_resizer(self) -> FrameResizer | None:
        """`frame_resizer` for this processor's uint8 frames, checked on first use; None where it does not apply."""
        frames = self.uint8_frames
        if frames is None:
            return None
        return frame_resizer(
            self.image_processor, self.merge, frames[1], self._resize_pool, self._resize_strips, self.image_grid
        )

    @cached_property
    def _frames(self) -> Any:
        """`normalised_frames` for this processor: its normalised image, for processors the uint8 layout misses."""
        return normalised_frames(self.image_processor, self._geometry)

    def image_grid(self, width: int, height: int) -> tuple[int, int, int] | None:
        """The patch grid `process_image` gives an image of this size (after EXIF orientation), found by the
        processor's own resize run on a meta tensor: no pixels. None where it cannot be told in advance (a
        processor that does not resize). Raises ValueError where the processor refuses the size."""
        # Kept per size: the meta-tensor resize costs ~3-6 ms of dispatch (most of a deferred image's planning),
        # and a request's pages or a camera's frames share a handful of sizes.
        grids = self._grids
        if (width, height) in grids:
            return grids.get((width, height))  # get: a pool thread's clear() may come in between
        ip = self.image_processor
        grid: tuple[int, int, int] | None = None
        if getattr(ip, "do_resize", False):
            patch = int(ip.patch_size)
            meta = torch.empty((1, 3, height, width), dtype=torch.uint8, device="meta")
            h, w = ip.resize(images=meta, size=ip.size, resample=ip.resample, factor=patch * self.merge).shape[-2:]
            grid = (1, int(h) // patch, int(w) // patch)
        if len(grids) >= 4096:
            grids.clear()
        grids[width, height] = grid
        return grid

    # ---- prompts --------------------------------------------------------------------------------
    def render(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        options: dict[str, Any] | None = None,
    ) -> Rendered:
        """Apply the chat template; image parts become the model's image placeholder.

        Text that came from the client is put through the template as a sentinel and returned apart from
        the template's own text, so ``build`` can tokenize it with special-token strings kept as text:
        only the chat template inserts control tokens (a user typing ``<|im_end|>`` cannot end its turn).
        A template that transforms content (strips it, branches on it) sees the sentinel, not the text; so
        the real text is rendered too, and where the two disagree the real rendering is used as one template
        piece -- unless some client text holds a special-token string, where keeping it text comes first.

        Tool results, the names and arguments of earlier tool calls and the tool definitions are client text
        too. Templates write a tool as ``tool | tojson``: it goes in as a one-key object whose key is a
        sentinel, and the JSON tojson makes of that is turned back into the sentinel (whose text is the
        tool's JSON, as tojson would have written it). ``options``: more apply_chat_template arguments (default: a
        generation prompt). Raises ValueError when ``tools`` are given and the template has no place for them, or
        reads into them while client text holds a special-token string."""
        texts: list[str] = []

        def hold(text: Any) -> str:
            texts.append(str(text))
            return f"{_SENTINEL}{len(texts) - 1}{_SENTINEL}"

        held = [self._plain(message, hold) for message in messages]
        refs = [hold(json.dumps(tool, ensure_ascii=False)) for tool in tools] if tools else []
        plain = [self._plain(message, str) for message in messages]
        real = self._apply_template(plain, tools, options)
        if tools and real == self._apply_template(plain, None, options):
            raise ValueError("the model's chat template does not render tools")
        if not any(self._has_special(t) for t in texts):
            # Nothing to keep apart: the template's own rendering, tokenized in one pass (token_ids), is
            # exactly what transformers tokenizes; the sentinel rendering would buy nothing.
            return Rendered([(real, False)])
        text = self._apply_template(held, [{ref: 0} for ref in refs] or None, options)
        written = [json.dumps({ref: 0}, ensure_ascii=False) for ref in refs]
        tools_held = all(w in text for w in written)  # False: the template reads into a tool
        for ref, w in zip(refs, written, strict=True):
            text = text.replace(w, ref)
        pieces: list[tuple[str, bool]] = []
        for i, chunk in enumerate(text.split(_SENTINEL)):
            # Odd chunks are sentinel indices: the client's text; even chunks are the template's.
            if i % 2:
                pieces.append((texts[int(chunk)], True))
            elif chunk:
                pieces.append((chunk, False))
        rendered = Rendered(pieces)
        if real != rendered.text and not tools_held:
            raise ValueError("client text holds a control-token string and the template reads into the tools")
        return rendered

    @staticmethod
    def _plain(message: dict[str, Any], text: Any) -> dict[str, Any]:
        content = message.get("content")
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for part in content:
                if part.get("type") in ("image", "image_url", "input_image"):
                    parts.append({"type": "image"})
                elif part.get("type") in ("video", "video_url"):
                    parts.append({"type": "video"})
                else:
                    parts.append({"type": "text", "text": text(part.get("text", ""))})
            return {**message, "content": parts}
        out = {**message, "content": text(content)} if isinstance(content, str) else dict(message)
        if message.get("tool_calls"):
            out["tool_calls"] = [_called(call, text) for call in message["tool_calls"]]
        return out

    def _apply_template(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None, options: dict[str, Any] | None = None
    ) -> str:
        extra: dict[str, Any] = {"add_generation_prompt": True, **(options or {})}
        if tools:
            extra["tools"] = tools
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, **extra))

    def _has_special(self, text: str) -> bool:
        return any(token in text for token in self._special_strings)

    def token_ids(self, rendered: Rendered | str) -> list[int]:
        """Tokenize a rendered prompt: the template's text with its special tokens, the client's text with
        special-token strings split into ordinary tokens. The pieces meet at pretokenizer boundaries (a
        newline or a special token on the template's side), so this equals tokenizing the joined string
        whenever the client's text holds no special-token string."""
        if isinstance(rendered, str):
            rendered = Rendered([(rendered, False)])
        if not any(client and self._has_special(text) for text, client in rendered.pieces):
            # Nothing to keep apart: one pass over the whole text, as transformers tokenizes it (pieces
            # do not always meet at pretokenizer boundaries: "." + "\n\n" is one pretoken, "}" + "}" too).
            return list(self.tokenizer(rendered.text, add_special_tokens=False)["input_ids"])
        ids: list[int] = []
        for text, client in rendered.pieces:
            out = self.tokenizer(text, add_special_tokens=False, split_special_tokens=client)["input_ids"]
            ids.extend(out)
        return ids

    def tokens_for_grid(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def build(self, text: Rendered | str, media: Sequence[ImageMeta | VideoMeta]) -> Prompt:
        """Tokenize ``text`` (one placeholder per image or video, in prompt order) and expand each image
        placeholder into the image's span, each video's into its frame groups' spans laid out as the family
        lays a video out (Qwen3-VL: each group after its timestamp text)."""
        images = [m for m in media if not isinstance(m, VideoMeta)]
        videos = [m for m in media if isinstance(m, VideoMeta)]
        ids = self.token_ids(self._lay_out_videos(text, videos) if videos else text)
        groups = [(g, (i, t)) for v in videos for i, (g, t) in enumerate(zip(v.groups, v.frame_t, strict=True))]
        image_id, video_id = self.info.image_token_id, self.info.video_token_id
        slots = [i for i, tok in enumerate(ids) if tok == image_id or tok == video_id]
        n_images = sum(1 for i in slots if ids[i] == image_id)
        if n_images != len(images) or len(slots) - n_images != len(groups):
            raise ValueError(
                f"the prompt has {n_images} image placeholders but {len(images)} images were given"
                if n_images != len(images)
                else f"the prompt has {len(slots) - n_images} video frame placeholders, the videos {len(groups)} frame groups"
            )
        next_image, next_group = iter(images), iter(groups)
        input_ids: list[int] = []
        spans: list[ImageSpan] = []
        cursor = 0
        for slot in slots:
            input_ids.extend(ids[cursor:slot])
            frame: tuple[int, int] | None = None
            if ids[slot] == image_id:
                item: ImageMeta = next(next_image)
            else:
                item, frame = next(next_group)
            spans.append(ImageSpan(item.hash, len(input_ids), item.num_tokens, item.grid, frame))
            input_ids.extend([pad_value(item.hash)] * item.num_tokens)
            cursor = slot + 1
        input_ids.extend(ids[cursor:])
        delta = self.family.delta(len(input_ids), item_spans(spans), self.merge)
        return Prompt(input_ids, delta, spans)

    def _lay_out_videos(self, text: Rendered | str, videos: Sequence[VideoMeta]) -> Rendered:
        """Replace each video placeholder of the template's text with its video's layout (timestamps are
        text, so this happens before tokenizing, where transformers' processor does it too). Client text is
        never searched: a placeholder typed by a client stays text."""
        assert self.video is not None
        pad = self.video.tokens[0]
        rendered = Rendered([(text, False)]) if isinstance(text, str) else text
        found = sum(piece.count(pad) for piece, client in rendered.pieces if not client)
        if found != len(videos):
            raise ValueError(f"the prompt has {found} video placeholders but {len(videos)} videos were given")
        layouts = iter(v.text for v in videos)
        pieces: list[tuple[str, bool]] = []
        for piece, client in rendered.pieces:
            if client or pad not in piece:
                pieces.append((piece, client))
                continue
            parts = piece.split(pad)
            pieces.append(("".join(p + next(layouts) for p in parts[:-1]) + parts[-1], False))
        return Rendered(pieces)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))
