"""Prompt building for the Qwen-style VLM families: chat template, image processing, content hashing and
placeholder expansion (M-RoPE positions are left to the model workers, which derive them from the spans). Runs where the tokenizer runs (a tokenizer process when serving,
the caller's process for the offline Engine), never on an event loop.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import blake3
import torch
from PIL import Image
from transformers import AutoProcessor

from workers.engine.models import family as family_package, load_spec
from workers.engine.models.base import ModelSpec

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
    pixel_values: torch.Tensor  # [t * h * w, channels * temporal_patch * patch**2] float32


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


@dataclass(frozen=True)
class Prompt:
    input_ids: list[int]  # image spans hold hash-derived pad values
    mrope_delta: int  # a decoded token at index p sits at position p + mrope_delta on every row
    spans: list[ImageSpan]


class MMProcessor:
    """Tokenizer + image processor of one checkpoint."""

    def __init__(self, model_dir: str | Path, spec: ModelSpec | None = None) -> None:
        self.info = spec or load_spec(model_dir)
        self.family = family_package(self.info.family)
        self.hf = AutoProcessor.from_pretrained(str(model_dir))
        self.tokenizer = self.hf.tokenizer
        self.image_processor = self.hf.image_processor
        self.merge = int(getattr(self.image_processor, "merge_size", self.info.spatial_merge_size))
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.info.image_token_id)
        # Strings the tokenizer would turn into control tokens (special and added tokens alike).
        self._special_strings = tuple(str(t) for t in self.tokenizer.get_added_vocab())
        settings = json.dumps(self.image_processor.to_dict(), sort_keys=True, default=str)
        # Everything that changes the pixels the ViT sees goes into every image's hash.
        self._settings_digest = blake3.blake3(settings.encode()).digest(16)

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

    def process_image(self, image: Image.Image, image_hash: bytes | None = None) -> ProcessedImage:
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        out = self.image_processor(images=[rgb], return_tensors="pt")
        t, h, w = (int(v) for v in out["image_grid_thw"][0].tolist())
        pixels = out["pixel_values"].to(torch.float32).contiguous()
        return ProcessedImage(
            hash=image_hash if image_hash is not None else self.hash_image(rgb),
            grid=(t, h, w),
            num_tokens=self.tokens_for_grid((t, h, w)),
            pixel_values=pixels,
        )

    # ---- prompts --------------------------------------------------------------------------------
    def render(self, messages: Sequence[dict[str, Any]]) -> Rendered:
        """Apply the chat template; image parts become the model's image placeholder.

        Text that came from the client is put through the template as a sentinel and returned apart from
        the template's own text, so ``build`` can tokenize it with special-token strings kept as text:
        only the chat template inserts control tokens (a user typing ``<|im_end|>`` cannot end its turn).
        A template that transforms content (strips it, branches on it) sees the sentinel, not the text; so
        the real text is rendered too, and where the two disagree the real rendering is used as one template
        piece -- unless some client text holds a special-token string, where keeping it text comes first."""
        texts: list[str] = []

        def hold(text: Any) -> str:
            texts.append(str(text))
            return f"{_SENTINEL}{len(texts) - 1}{_SENTINEL}"

        held = [self._plain(message, hold) for message in messages]
        text = self._apply_template(held)
        pieces: list[tuple[str, bool]] = []
        for i, chunk in enumerate(text.split(_SENTINEL)):
            # Odd chunks are sentinel indices: the client's text; even chunks are the template's.
            if i % 2:
                pieces.append((texts[int(chunk)], True))
            elif chunk:
                pieces.append((chunk, False))
        rendered = Rendered(pieces)
        real = self._apply_template([self._plain(message, str) for message in messages])
        if real == rendered.text or any(self._has_special(t) for t in texts):
            return rendered
        return Rendered([(real, False)])

    @staticmethod
    def _plain(message: dict[str, Any], text: Any) -> dict[str, Any]:
        content = message.get("content")
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for part in content:
                if part.get("type") in ("image", "image_url", "input_image"):
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": text(part.get("text", ""))})
            return {**message, "content": parts}
        if isinstance(content, str):
            return {**message, "content": text(content)}
        return dict(message)

    def _apply_template(self, messages: list[dict[str, Any]]) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def _has_special(self, text: str) -> bool:
        return any(token in text for token in self._special_strings)

    def token_ids(self, rendered: Rendered | str) -> list[int]:
        """Tokenize a rendered prompt: the template's text with its special tokens, the client's text with
        special-token strings split into ordinary tokens. The pieces meet at pretokenizer boundaries (a
        newline or a special token on the template's side), so this equals tokenizing the joined string
        whenever the client's text holds no special-token string."""
        if isinstance(rendered, str):
            rendered = Rendered([(rendered, False)])
        ids: list[int] = []
        for text, client in rendered.pieces:
            out = self.tokenizer(text, add_special_tokens=False, split_special_tokens=client)["input_ids"]
            ids.extend(out)
        return ids

    def tokens_for_grid(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def build(self, text: Rendered | str, images: Sequence[ImageMeta]) -> Prompt:
        """Tokenize ``text`` (one image placeholder per image) and expand each placeholder into the image's span."""
        ids = self.token_ids(text)
        slots = [i for i, tok in enumerate(ids) if tok == self.info.image_token_id]
        if len(slots) != len(images):
            raise ValueError(f"the prompt has {len(slots)} image placeholders but {len(images)} images were given")
        input_ids: list[int] = []
        spans: list[ImageSpan] = []
        cursor = 0
        for slot, image in zip(slots, images, strict=True):
            input_ids.extend(ids[cursor:slot])
            spans.append(ImageSpan(image.hash, len(input_ids), image.num_tokens, image.grid))
            input_ids.extend([pad_value(image.hash)] * image.num_tokens)
            cursor = slot + 1
        input_ids.extend(ids[cursor:])
        delta = self.family.delta(len(input_ids), [(s.offset, s.length, s.grid) for s in spans], self.merge)
        return Prompt(input_ids, delta, spans)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))
