"""KV-cache events in vLLM's wire format, published over ZMQ for external prefix-cache indexers (llm-d's
precise prefix-cache scorer and anything else that reads vLLM's events).

This is an external format, not one of glimpse's own messages (those are in ipc/control.py and the per-hop
modules beside it): field order, tags and framing follow what vLLM publishes and llm-d decodes, so an indexer
built for vLLM reads glimpse unchanged.

Framing: one ZMQ PUB message per batch, three frames: ``[topic, sequence (8-byte big-endian), payload]``.
The payload is msgpack of ``KVEventBatch`` as an array ``[ts, events, data_parallel_rank]``; each event is
an array whose first element is its tag (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``),
then its fields in declaration order (msgspec writes every field of an array, defaults included, so each length
that goes out is its own struct below).

Block hashes are integers: the first 8 bytes of glimpse's 16-byte prefix-cache key, big-endian, unsigned
(README, "Prefix-cache keys"). ``extra_keys`` (vLLM's newer field) has one entry per stored block: None for
a text-only block, else a list of ``[image hash (32 hex digits), offset of the block's first token inside
the image]`` for every image the block overlaps, exactly what the key hashes besides the tokens. A
BlockStored none of whose blocks covers an image is sent without it (8 elements, as vLLM sent it before
the field existed): decoders that read a fixed array of 8 (llm-d's) take those unchanged, and decoders
that know the field read it as absent.

Hybrid models (Qwen3.5's linear attention) publish two KV-cache groups, as vLLM does: group 0
(``kv_cache_spec_kind`` "full_attention") for the attention layers' blocks, and group 1 ("mamba") for the blocks
at whose end a recurrent-state snapshot is kept, the only places a prefix hit can resume. BlockStored then
carries ``extra_keys`` (or nil), ``group_idx`` and ``kv_cache_spec_kind`` as its 9th-11th fields, BlockRemoved
``group_idx`` as its 3rd; other models send neither.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgspec
import zmq

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
_HWM = 100_000  # batches queued for a slow subscriber before PUB drops (it never blocks the scheduler)


class KVCacheEvent(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, tag=True):
    """Base of the events: tagged with the class name, encoded as arrays."""


class BlockStored(KVCacheEvent, frozen=True):
    block_hashes: list[int]  # a chain: each block's parent is the one before it
    parent_block_hash: int | None  # the block before the first one; None at the start of a sequence
    token_ids: list[int]  # the blocks' tokens, block_size per block
    block_size: int
    # Required, as in vLLM, so every event carries them (an array decoder reads fields by position).
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[tuple[str, int]] | None] | None = None
    # Hybrid models only (as vLLM sends them for its KV-cache groups): which group the blocks belong to and its kind.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _TextBlockStored(KVCacheEvent, frozen=True, tag="BlockStored"):
    """BlockStored without ``extra_keys``: what goes out when no block of the event covers an image."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _ImageBlockStored(_TextBlockStored, frozen=True, tag="BlockStored"):
    """BlockStored with ``extra_keys`` and no group fields: a model of one KV-cache group, blocks with images."""

    extra_keys: list[list[tuple[str, int]] | None] | None = None


def block_stored(
    hashes: list[int], parent: int | None, tokens: list[int], block_size: int, medium: str,
    extra_keys: list[list[tuple[str, int]] | None] | None, group: tuple[int, str] | None = None,
) -> KVCacheEvent:
    """A BlockStored event (no LoRA), in its short form when no block covers an image and no ``group`` (a hybrid
    model's KV-cache group: index and kind) is named."""
    if group is not None:
        return BlockStored(hashes, parent, tokens, block_size, None, medium, None, extra_keys, *group)
    if extra_keys is None or all(e is None for e in extra_keys):
        return _TextBlockStored(hashes, parent, tokens, block_size, None, medium, None)
    return _ImageBlockStored(hashes, parent, tokens, block_size, None, medium, None, extra_keys)


class BlockRemoved(KVCacheEvent, frozen=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None  # hybrid models: the KV-cache group (see BlockStored)


class _PlainBlockRemoved(KVCacheEvent, frozen=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


def block_removed(hashes: list[int], medium: str, group: int | None = None) -> KVCacheEvent:
    """A BlockRemoved event; ``group`` only for hybrid models (msgspec writes every field of an array, defaults too, so
    each form is its own struct)."""
    return _PlainBlockRemoved(hashes, medium) if group is None else BlockRemoved(hashes, medium, group)


class AllBlocksCleared(KVCacheEvent, frozen=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """What a subscriber decodes."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _OutgoingBatch(msgspec.Struct, frozen=True, array_like=True):
    """The same layout as sent: events of any form (``block_stored`` picks BlockStored's)."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


def external_hash(key: bytes) -> int:
    """The integer an event carries for a 16-byte prefix-cache key."""
    return int.from_bytes(key[:8], "big")


def replica_endpoint(endpoint: str, replica: int) -> str:
    """Replica ``replica``'s endpoint: the port plus the replica for tcp, a suffix for ipc (vLLM's rule for
    data-parallel ranks, so one flag serves every replica)."""
    if replica == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + replica}"
    return f"{endpoint}_dp{replica}"


class KVEventPublisher:
    """A PUB socket sending ``KVEventBatch``es with consecutive sequence numbers. An endpoint with a
    wildcard ("*") or an ipc:// path is bound (subscribers connect to us); any other is connected to (a
    subscriber that binds, as llm-d's indexer may): vLLM's convention."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, topic: str, replica: int) -> None:
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.replica = replica
        self._seq = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._sock: zmq.Socket[Any] = ctx.socket(zmq.PUB)
        try:
            self._sock.setsockopt(zmq.SNDHWM, _HWM)
            if "*" in endpoint or endpoint.startswith("ipc://"):
                self._sock.bind(endpoint)
            else:
                self._sock.connect(endpoint)
        except BaseException:
            self._sock.close(linger=0)
            raise

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        batch = _OutgoingBatch(time.time(), events, self.replica)
        seq = next(self._seq).to_bytes(8, "big")
        # NOBLOCK: PUB drops past the high-water mark rather than block; never stall a scheduler step on
        # a subscriber.
        self._sock.send_multipart([self.topic, seq, self._encoder.encode(batch)], flags=zmq.NOBLOCK)

    def close(self, linger_ms: int = 0) -> None:
        if not self._sock.closed:
            self._sock.close(linger=linger_ms)
