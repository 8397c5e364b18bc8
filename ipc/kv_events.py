"""KV-cache events in vLLM's wire format, for external prefix-cache indexers (llm-d's precise prefix-cache
scorer and anything else that reads vLLM's events). docs/kv-events.md has the layout, the identifiers, the
key algorithm an indexer runs on them and the sources each fact was checked against.

This is an external format, not one of glimpse's own messages (those are in ipc/control.py and the per-hop
modules beside it): field names, order, tags and framing follow what vLLM publishes and llm-d decodes.

Payload: msgpack of a batch, always the array ``[ts, events, data_parallel_rank]``. Each event, in the default
``map`` layout (vLLM >= 0.24, vllm-project/vllm#42892), is a map tagged under ``"type"``: BlockStored
``{type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name[, extra_keys]
[, group_idx, kv_cache_spec_kind]}`` (the first seven always present, None included; the rest only when set,
msgspec's omit_defaults as vLLM's), BlockRemoved ``{type, block_hashes, medium[, group_idx]}``,
AllBlocksCleared ``{type}``. The ``array`` layout (vLLM <= 0.23, ``--kv-events-layout array``) writes the same
fields positionally, tag first, trailing unset fields left off.

``token_ids`` are the prompt's tokens as vLLM has them: an image's or video's span holds the checkpoint's
``image_token_id`` / ``video_token_id``, not glimpse's internal pad values. ``extra_keys`` has one entry per
stored block: None for a block that covers no media, else ``[identifier, offset]`` for every media item it
overlaps, in prompt order: the item's identifier (``media_spans``) and where the item starts relative to the
block's first token (negative when it began in an earlier block), vLLM's ``(mm_feature.identifier, offset)``. Block hashes are integers: the first 8 bytes of glimpse's 16-byte prefix-cache key,
big-endian (README, "Prefix-cache keys"); indexers use them only to pair stores with removals.

Hybrid models (Qwen3.5's linear attention) publish two KV-cache groups, as vLLM does: group 0 ("full_attention")
for the attention layers' blocks and group 1 ("mamba") for the blocks at whose end a recurrent-state snapshot
is kept; other models send no group fields.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from ipc.prompts import MMItem

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
Layout = Literal["map", "array"]
LAYOUTS: tuple[Layout, ...] = ("map", "array")
ExtraKeys = list[list[tuple[str, int]] | None]


class KVCacheEvent(msgspec.Struct, frozen=True, omit_defaults=True, tag=True):
    """Base of the events: a map tagged ``"type": <class name>`` (msgspec's default tag field, vLLM's)."""


class BlockStored(KVCacheEvent, frozen=True):
    block_hashes: list[int]  # a chain: each block's parent is the one before it
    parent_block_hash: int | None  # the block before the first one; None at the start of a sequence
    token_ids: list[int]  # the blocks' tokens, block_size per block (media spans: the real media token ids)
    block_size: int
    # No default, as in vLLM: always on the wire, None included.
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: ExtraKeys | None = None  # per block: (identifier, item start - block start) per media item, or None
    # Hybrid models only: which KV-cache group the blocks belong to and its kind.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(KVCacheEvent, frozen=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None  # hybrid models: the KV-cache group (see BlockStored)


class AllBlocksCleared(KVCacheEvent, frozen=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """One published batch (map layout), as a subscriber decodes it."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def block_stored(
    hashes: list[int], parent: int | None, tokens: list[int], block_size: int, medium: str,
    extra_keys: ExtraKeys | None, group: tuple[int, str] | None = None,
) -> BlockStored:
    """A BlockStored event (no LoRA): ``extra_keys`` is left off when no block covers media, ``group`` (a hybrid
    model's KV-cache group: index and kind) only when named."""
    if extra_keys is not None and all(e is None for e in extra_keys):
        extra_keys = None
    index, kind = group if group is not None else (None, None)
    return BlockStored(hashes, parent, tokens, block_size, None, medium, None, extra_keys, index, kind)


def block_removed(hashes: list[int], medium: str, group: int | None = None) -> BlockRemoved:
    return BlockRemoved(hashes, medium, group)


def _as_array(event: KVCacheEvent) -> list[Any]:
    """vLLM <= 0.23's positional form: tag, then the fields in order, trailing unset ones left off (decoders of
    that era read a fixed 8-element BlockStored and take longer ones by position)."""
    if isinstance(event, BlockStored):
        row: list[Any] = ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids,
                          event.block_size, event.lora_id, event.medium, event.lora_name]
        tail = [event.extra_keys, event.group_idx, event.kv_cache_spec_kind]
    elif isinstance(event, BlockRemoved):
        row, tail = ["BlockRemoved", event.block_hashes, event.medium], [event.group_idx]
    else:
        row, tail = [type(event).__name__], []
    while tail and tail[-1] is None:
        tail.pop()
    return row + tail


class BatchEncoder:
    """Encodes one replica's batches in the chosen layout (the scheduler encodes; the publisher only frames)."""

    def __init__(self, layout: Layout, replica: int) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"KV-event layout must be one of {LAYOUTS}, not {layout!r}")
        self.layout, self.replica = layout, replica
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, events: list[KVCacheEvent]) -> bytes:
        body: list[Any] = list(events) if self.layout == "map" else [_as_array(e) for e in events]
        return self._encoder.encode([time.time(), body, self.replica])


def external_hash(key: bytes) -> int:
    """The integer an event carries for a 16-byte prefix-cache key."""
    return int.from_bytes(key[:8], "big")


class MediaSpan(msgspec.Struct, frozen=True):
    """One image or video as vLLM's multimodal features name it: its identifier and its placeholder range."""

    identifier: str
    modality: Literal["image", "video"]
    offset: int  # first placeholder token
    end: int  # one past the last


def media_spans(items: list[MMItem]) -> list[MediaSpan]:
    """The request's media as vLLM counts them, in prompt order: an image is one item; a video, which glimpse
    splits into frame groups (each its own MMItem), is one item named by its first group's ``external_id`` (the
    client's uuid, shared by all its groups, or group 0's content hash) and spanning from its first group's
    first token to its last group's last (the timestamps and frame markers between groups included)."""
    spans: list[MediaSpan] = []
    for it in sorted(items, key=lambda it: it.offset):
        end = it.offset + it.length
        if it.frame is not None and it.frame[0] > 0 and spans and spans[-1].modality == "video":
            spans[-1] = MediaSpan(spans[-1].identifier, "video", spans[-1].offset, end)
        else:
            spans.append(MediaSpan(it.external_id, "image" if it.frame is None else "video", it.offset, end))
    return spans


def vllm_tokens(tokens: list[int], lo: int, items: list[MMItem], image_id: int, video_id: int) -> list[int]:
    """``tokens`` (the prompt from position ``lo`` on) with every media span's positions set to the checkpoint's
    image or video token id, as vLLM's prompt has them."""
    out = list(tokens)
    hi = lo + len(out)
    for it in items:
        a, b = max(it.offset, lo), min(it.offset + it.length, hi)
        if a < b:
            out[a - lo : b - lo] = [image_id if it.frame is None else video_id] * (b - a)
    return out


def block_media(spans: list[MediaSpan], lo: int, hi: int) -> list[tuple[str, int]] | None:
    """vLLM's multimodal extra keys of the block of tokens [lo, hi): ``(identifier, item offset - lo)`` for every
    media item overlapping it, in prompt order; None when none does."""
    keys = [(s.identifier, s.offset - lo) for s in spans if s.offset < hi and s.end > lo]
    return keys or None
