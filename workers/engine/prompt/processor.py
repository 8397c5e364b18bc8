"""Prompt building for the VLM families: image processing, content hashing and placeholder expansion around the
chat template (chat_template.py renders and tokenizes). M-RoPE positions are left to the model workers, which derive
them from the spans. Runs where the tokenizer runs (a tokenizer process when serving, the caller's process for the
offline Engine), never on an event loop.

The Qwen-style processors are driven here directly (with pixel_frames.py's fast paths); a family whose processor
works otherwise brings its own image side (``FamilyImages``, the family's ``images`` hook: Gemma 4's per-image token
budgets, and the ids around each image's span).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor
from transformers.image_utils import SizeDict

from workers.engine.models import family as family_package, load_spec
from workers.engine.models.base import item_spans
from workers.engine.models.model_spec import ModelSpec
from workers.engine.prompt.chat_template import ChatTemplate, Rendered
from workers.engine.prompt.media_items import (
    FamilyImages,
    ImageMeta,
    ImageSpan,
    ProcessedImage,
    Prompt,
    pad_value,
)
from workers.engine.prompt.pixel_frames import (
    FrameLayout,
    FrameResizer,
    frame_layout,
    frame_resizer,
    normalised_frames,
)
from workers.engine.prompt.video_prompt import VideoMeta, VideoProcessor


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
        hook = self.family.images  # the Qwen families have none
        self.images: FamilyImages | None = (
            hook(self.hf, self.info, self._resize_pool, self._resize_strips) if hook is not None else None
        )
        self.merge = int(getattr(self.image_processor, "merge_size", self.info.spatial_merge_size))
        ip = self.image_processor
        self._geometry = (int(getattr(ip, "patch_size", 0)), self.merge, int(getattr(ip, "temporal_patch_size", 1)))
        # image_grid's answers by (width, height), and the budget for families with budgets
        self._grids: dict[tuple[int, ...], tuple[int, int, int] | None] = {}
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.info.image_token_id)
        self.template = ChatTemplate(self.tokenizer)
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
    @property
    def budgets(self) -> tuple[int, ...]:
        """The image token budgets a request may ask for (empty: the family has none)."""
        return self.images.budgets if self.images is not None else ()

    def budget(self, budget: int | None) -> int | None:
        """``budget`` checked, the default where None or equal to it (so the hashes agree); None for families without
        budgets. Raises ValueError for a budget the family does not take."""
        if self.images is None:
            if budget is not None:
                raise ValueError(f"{self.info.family} images take no token budget")
            return None
        if budget is None:
            return self.images.default_budget
        if budget not in self.images.budgets:
            raise ValueError(f"an image's token budget must be one of {self.images.budgets}, not {budget}")
        return budget

    def budgeted(self, image_hash: bytes, budget: int | None) -> bytes:
        """The hash of an image at ``budget``: another budget gives other tokens (another image to the caches), while
        the default budget keeps the plain hash, which the processor settings in it already cover."""
        checked = self.budget(budget)
        if checked is None or self.images is None or checked == self.images.default_budget:
            return image_hash
        return blake3.blake3(b"glimpse-budget-v1" + checked.to_bytes(4, "little") + image_hash).digest(16)

    def hash_image(self, image: Image.Image, budget: int | None = None) -> bytes:
        """Content hash framed with mode, size and processor settings (16 bytes), and the token ``budget``."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        h = blake3.blake3(b"glimpse-image-v1")
        h.update(self._settings_digest)
        h.update(f"{rgb.mode}:{rgb.width}x{rgb.height}:uint8".encode())
        h.update(rgb.tobytes())
        return self.budgeted(h.digest(16), budget)

    def media_hash(self, raw: bytes, budget: int | None = None) -> bytes:
        """Hash of an encoded media file as received (16 bytes), framed with the processor settings, and the token
        ``budget``.

        Used when serving: hashing the encoded bytes lets a tokenizer recognise a resent image
        before decoding it. Its own tag keeps it apart from `hash_image`'s pixel hashes.
        """
        h = blake3.blake3(b"glimpse-media-v1")
        h.update(self._settings_digest)
        h.update(raw)
        return self.budgeted(h.digest(16), budget)

    def process_image(
        self, image: Image.Image | np.ndarray, image_hash: bytes | None = None, frame: bool = False,
        budget: int | None = None, size: dict[str, int] | None = None,
    ) -> ProcessedImage:
        """The image's patch rows, as the checkpoint's processor makes them. With ``frame``, what shared memory
        should hold instead: the resized uint8 frame (pixel_frames.py), else the normalised image for
        `ProcessedImage.write_rows` to lay out, for processors whose fast paths give the full path's bits.
        ``image`` may be [H, W, 3] uint8 RGB pixels (`decode_pixels`), which the uint8 frame's resize reads.
        ``budget``: the image's token budget (families with budgets; None: the default). ``image_hash``, when given,
        must be the image's hash at that budget. ``size``: a request's pixel range (pixel_range.py; None: the
        checkpoint's), for which the processor's own call resizes (not the fast resize, which is checked at its size)."""
        if self.images is not None:
            if size is not None:
                raise ValueError(f"{self.info.family} images take a token budget, not a pixel range")
            return self._family_image(image, image_hash, budget, frame)
        self.budget(budget)  # refuses a budget for a family without them
        # Each fast path is checked on the first such call (the offline Engine never asks for one).
        uint8_frames = self.uint8_frames if frame else None
        uint8 = uint8_frames is not None
        framed = frame and not uint8 and self._frames is not None
        resize = self._frame_resizer if uint8 and size is None else None
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
            out = ip(images=[rgb], return_tensors="pt", **({"size": size} if size is not None else {}))
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

    def _family_image(
        self, image: Image.Image | np.ndarray, image_hash: bytes | None, budget: int | None, frame: bool = False
    ) -> ProcessedImage:
        """`process_image` through the family's own image side: patch rows, or with ``frame`` the resized uint8 frame
        where the family has a frame layout."""
        assert self.images is not None
        rgb = image if isinstance(image, np.ndarray) or image.mode == "RGB" else image.convert("RGB")
        checked = self.budget(budget)
        assert checked is not None
        uint8 = frame and self.images.frame_layout is not None
        pixels, grid = self.images.frame(rgb, checked) if uint8 else self.images.rows(rgb, checked)
        if image_hash is None:
            image_hash = self.hash_image(Image.fromarray(rgb, "RGB") if isinstance(rgb, np.ndarray) else rgb, checked)
        return ProcessedImage(
            hash=image_hash,
            grid=grid,
            num_tokens=self.tokens_for_grid(grid),
            pixel_values=pixels,
            frame=self._geometry if uint8 else None,
            uint8=uint8,
        )

    @cached_property
    def uint8_frames(self) -> tuple[FrameLayout, Any] | None:
        """The layout of this processor's images as uint8 frames in shm, and the processor copy that makes them
        (None for a family with its own image side, which makes its frames itself: its layout, or None, is its own
        ``frame_layout``); None where its rows would not come out the same bits (then frames are normalised, or
        rows)."""
        if self.images is not None:
            return (self.images.frame_layout, None) if self.images.frame_layout is not None else None
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
        """`normalised_frames` for this processor: its normalised image, for processors the uint8 layout misses (never
        for a family with its own image side)."""
        if self.images is not None:
            return None
        return normalised_frames(self.image_processor, self._geometry)

    def image_grid(
        self, width: int, height: int, budget: int | None = None, size: dict[str, int] | None = None
    ) -> tuple[int, int, int] | None:
        """The patch grid `process_image` gives an image of this size (after EXIF orientation) at ``budget``, found by
        the processor's own resize run on a meta tensor (or the family's own arithmetic): no pixels. None where it
        cannot be told in advance (a processor that does not resize). Raises ValueError where the processor refuses
        the size or the budget. ``size``: a request's pixel range (pixel_range.py; None: the checkpoint's)."""
        budget = self.budget(budget)
        # Kept per size: the meta-tensor resize costs ~3-6 ms of dispatch (most of a deferred image's planning),
        # and a request's pages or a camera's frames share a handful of sizes.
        grids = self._grids
        key = (width, height) if budget is None else (width, height, budget)
        if size is not None:
            key = (*key, -size["shortest_edge"], -size["longest_edge"])  # negative: never a budget's key
        if key in grids:
            return grids.get(key)  # get: a pool thread's clear() may come in between
        ip = self.image_processor
        grid: tuple[int, int, int] | None = None
        if self.images is not None and budget is not None:
            grid = self.images.grid(width, height, budget)
        elif getattr(ip, "do_resize", False):
            patch = int(ip.patch_size)
            meta = torch.empty((1, 3, height, width), dtype=torch.uint8, device="meta")
            target = SizeDict(**size) if size is not None else ip.size
            h, w = ip.resize(images=meta, size=target, resample=ip.resample, factor=patch * self.merge).shape[-2:]
            grid = (1, int(h) // patch, int(w) // patch)
        if len(grids) >= 4096:
            grids.clear()
        grids[key] = grid
        return grid

    # ---- prompts --------------------------------------------------------------------------------
    def render(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        options: dict[str, Any] | None = None,
    ) -> Rendered:
        """Apply the chat template (`ChatTemplate.render`): client text kept apart from the template's own."""
        return self.template.render(messages, tools, options)

    def token_ids(self, rendered: Rendered | str) -> list[int]:
        """Tokenize a rendered prompt so that only the template inserts control tokens (`ChatTemplate.token_ids`)."""
        return self.template.token_ids(rendered)

    def tokens_for_grid(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def build(self, text: Rendered | str, media: Sequence[ImageMeta | VideoMeta]) -> Prompt:
        """Tokenize ``text`` (one placeholder per image or video, in prompt order) and expand each image
        placeholder into the image's span (between the family's wrapping ids, if it has them: Gemma 4's
        ``<|image>`` ... ``<image|>``; the span's offset is its first image token), each video's into its frame
        groups' spans laid out as the family lays a video out (Qwen3-VL: each group after its timestamp text)."""
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
        wrap = self.images.wrap if self.images is not None else None
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
            if wrap is not None and frame is None:
                input_ids.append(wrap[0])
            spans.append(ImageSpan(item.hash, len(input_ids), item.num_tokens, item.grid, frame))
            input_ids.extend([pad_value(item.hash)] * item.num_tokens)
            if wrap is not None and frame is None:
                input_ids.append(wrap[1])
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
