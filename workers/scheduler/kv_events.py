"""The scheduler's KV-cache events: what its prefix cache publishes and drops, as vLLM-format events
(ipc/kv_events.py) for external indexers such as llm-d's precise prefix-cache scorer.

Hooked into the scheduling core: ``SchedulerCore.on_blocks_stored`` fires when a sequence's full,
computed blocks are registered in the prefix cache (BlockStored: their keys, parent key, tokens and the
media they cover), ``BlockAllocator.on_evict`` when a registered block is recycled for other contents
(BlockRemoved). A fresh or stopping scheduler announces AllBlocksCleared, so an indexer forgets whatever
an earlier run of this replica published. Events collect during a loop turn and go out as one batch, encoded
here (with this replica's ``data_parallel_rank``) and handed to the launcher's publisher
(ipc/kv_event_publisher.py), which numbers and publishes every replica's batches on one stream.

Tokens go out as vLLM has them: a media span's positions hold the checkpoint's image/video token id, not the
pad values glimpse's prompts carry (distinct per image, so the prefix cache tells images apart by tokens too).
"""

from __future__ import annotations

from typing import Any, Protocol

import zmq

from ipc.kv_event_publisher import KVEventSender
from ipc.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BatchEncoder,
    KVCacheEvent,
    Layout,
    MediaSpan,
    block_media,
    block_removed,
    block_stored,
    external_hash,
    media_spans,
    vllm_tokens,
)
from workers.config import ServerConfig
from workers.engine.core.scheduler import SchedulerCore, Sequence

# A hybrid model's groups, named as vLLM names its KV-cache spec kinds.
KV_GROUP = (0, "full_attention")
STATE_GROUP = (1, "mamba")


class Sink(Protocol):
    """Where a flushed batch goes: the publisher's sender when serving, a list in tests."""

    def publish(self, events: list[KVCacheEvent]) -> None: ...

    def close(self, linger_ms: int = 0) -> None: ...


class EncodingSink:
    """Encodes a replica's batches and hands them to the launcher's publisher."""

    def __init__(self, sender: KVEventSender, layout: Layout, replica: int) -> None:
        self.sender, self.encoder = sender, BatchEncoder(layout, replica)
        self.endpoint = sender.endpoint

    def publish(self, events: list[KVCacheEvent]) -> None:
        self.sender.send(self.encoder.encode(events))

    def close(self, linger_ms: int = 0) -> None:
        self.sender.close(linger_ms)


def _runs(indices: list[int]) -> list[list[int]]:
    """Split sorted block indices into runs of consecutive ones (one BlockStored chain each)."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class KVEventRecorder:
    """Collects one replica's events between flushes and publishes them as one batch."""

    def __init__(self, publisher: Sink, block_size: int, medium: str, media_tokens: tuple[int, int] = (-1, -1)) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.medium = medium
        self.image_id, self.video_id = media_tokens  # the checkpoint's image_token_id and video_token_id
        self.events: list[KVCacheEvent] = []
        self._removed: list[int] = []  # consecutive evictions become one BlockRemoved
        # Hybrid models: KV blocks are group 0, state snapshots group 1 (ipc/kv_events.py); None: one group, unnamed.
        self.kv_group: tuple[int, str] | None = None
        self._snapshots_removed: list[int] = []
        self.published = 0
        # The prefix cache's host tier (a GPU replica's --kv-host-cache-mb), published as vLLM's offloading does:
        # the same block again under medium CPU when it spills, BlockRemoved CPU when the host lets it go. Each
        # block's (parent, tokens, media) is kept while either tier holds it, for the CPU store's event (only with a
        # host tier attached: without one nothing is kept).
        self._host_tier = False
        self._blocks: dict[int, tuple[int | None, list[int], Any]] = {}
        self._on_gpu: set[int] = set()
        self._on_host: set[int] = set()
        self._host_removed: list[int] = []

    @classmethod
    def open(cls, ctx: zmq.Context[Any], config: ServerConfig, replica: int) -> KVEventRecorder | None:
        """Replica ``replica``'s recorder, or None when ``--kv-events-endpoint`` is not set."""
        if not config.kv_events_endpoint:
            return None
        sink = EncodingSink(KVEventSender(ctx, config.launch_id), config.kv_events_layout, replica)
        medium = MEDIUM_GPU if config.engine.device.startswith("cuda") else MEDIUM_CPU
        spec = config.engine.model_spec()
        return cls(sink, config.engine.block_size, medium, (spec.image_token_id, spec.video_token_id))

    def attach(self, core: SchedulerCore) -> KVEventRecorder:
        core.on_blocks_stored = self.stored
        core.allocator.on_evict = self.removed
        if core.state is not None:
            self.kv_group = KV_GROUP
            core.on_snapshot_stored = self.snapshot_stored
            core.state.on_drop = self.snapshot_removed
        host = core.allocator.host
        if host is not None and self.medium != MEDIUM_CPU:  # on a CPU replica both tiers are one medium
            host.on_stored = self.host_stored
            host.on_removed = self.host_removed
            self._host_tier = True
        self.cleared()  # a new core holds nothing: whatever an earlier run published is gone
        return self

    def spans(self, seq: Sequence) -> list[MediaSpan]:
        return media_spans(seq.items) if seq.items else []  # a few items: cheaper to redo than to track

    def tokens(self, seq: Sequence, lo: int, hi: int) -> list[int]:
        tokens = seq.tokens_since(lo)[: hi - lo]
        return vllm_tokens(tokens, lo, seq.items, self.image_id, self.video_id) if seq.items else tokens

    def stored(self, seq: Sequence, indices: list[int], keys: list[bytes]) -> None:
        self._flush_removed()
        bs, spans = self.block_size, self.spans(seq)
        for run in _runs(indices):
            first, end = run[0], run[-1] + 1
            parent = external_hash(keys[first - 1]) if first > 0 else None
            extra = [block_media(spans, i * bs, (i + 1) * bs) for i in run]
            hashes = [external_hash(keys[i]) for i in run]
            tokens = self.tokens(seq, first * bs, end * bs)
            self.events.append(block_stored(hashes, parent, tokens, bs, self.medium, extra, self.kv_group))
            if not self._host_tier:
                continue
            for i, h in enumerate(hashes):
                self._blocks[h] = (hashes[i - 1] if i else parent, tokens[i * bs : (i + 1) * bs], extra[i])
                self._on_gpu.add(h)

    def host_stored(self, key: bytes) -> None:
        """A block copied to the host tier before its device block is reused: stored again, under medium CPU."""
        h = external_hash(key)
        block = self._blocks.get(h)
        if block is None:  # never published (its store predates this recorder): nothing an indexer could chain
            return
        parent, tokens, extra = block
        if parent is not None and parent not in self._on_gpu and parent not in self._on_host:
            # Its parent left both tiers (and the indexer's map): no prefix can reach this block, here or there.
            return
        self._flush_removed()
        self.events.append(block_stored([h], parent, tokens, self.block_size, MEDIUM_CPU, [extra], self.kv_group))
        self._on_host.add(h)

    def host_removed(self, key: bytes) -> None:
        h = external_hash(key)
        if h in self._on_host:
            self._on_host.discard(h)
            self._host_removed.append(h)
            self._forget_block(h)

    def _forget_block(self, h: int) -> None:
        if h not in self._on_gpu and h not in self._on_host:
            self._blocks.pop(h, None)

    def snapshot_stored(self, seq: Sequence, end: int, key: bytes) -> None:
        """A state snapshot at the end of block [end - bs, end) of ``seq``: a stored block of the state group."""
        self._flush_removed()
        bs, first = self.block_size, end // self.block_size - 1
        parent = external_hash(seq.block_hashes[first - 1]) if first > 0 else None
        extra = [block_media(self.spans(seq), end - bs, end)]
        tokens = self.tokens(seq, end - bs, end)
        self.events.append(block_stored([external_hash(key)], parent, tokens, bs, self.medium, extra, STATE_GROUP))

    def removed(self, key: bytes) -> None:
        h = external_hash(key)
        self._removed.append(h)
        if self._host_tier:
            self._on_gpu.discard(h)
            self._forget_block(h)

    def snapshot_removed(self, key: bytes) -> None:
        self._snapshots_removed.append(external_hash(key))

    def cleared(self) -> None:
        self._removed.clear()
        self._snapshots_removed.clear()
        self._host_removed.clear()
        self._blocks.clear()
        self._on_gpu.clear()
        self._on_host.clear()
        self.events.append(AllBlocksCleared())

    def _flush_removed(self) -> None:
        if self._removed:
            group = self.kv_group[0] if self.kv_group is not None else None
            self.events.append(block_removed(self._removed, self.medium, group))
            self._removed = []
        if self._snapshots_removed:
            self.events.append(block_removed(self._snapshots_removed, self.medium, STATE_GROUP[0]))
            self._snapshots_removed = []
        if self._host_removed:
            group = self.kv_group[0] if self.kv_group is not None else None
            self.events.append(block_removed(self._host_removed, MEDIUM_CPU, group))
            self._host_removed = []

    def flush(self) -> None:
        """Publish what collected since the last flush (one batch, one sequence number)."""
        self._flush_removed()
        if self.events:
            events, self.events = self.events, []
            self.publisher.publish(events)
            self.published += len(events)

    def close(self, linger_ms: int) -> None:
        self.cleared()  # the replica's cache goes with it
        self.flush()
        self.publisher.close(linger_ms)
