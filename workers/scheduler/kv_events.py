"""The scheduler's KV-cache events: what its prefix cache publishes and drops, as vLLM-format events
(ipc/kv_events.py) for external indexers such as llm-d's precise prefix-cache scorer.

Hooked into the scheduling core: ``SchedulerCore.on_blocks_stored`` fires when a sequence's full,
computed blocks are registered in the prefix cache (BlockStored: their keys, parent key, tokens and the
images they cover), ``BlockAllocator.on_evict`` when a registered block is recycled for other contents
(BlockRemoved). A fresh or stopping scheduler announces AllBlocksCleared, so an indexer forgets whatever
an earlier run of this replica published. Events collect during a loop turn and go out as one batch.
"""

from __future__ import annotations

from typing import Any

import zmq

from ipc.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    KVCacheEvent,
    KVEventPublisher,
    block_removed,
    block_stored,
    external_hash,
    replica_endpoint,
)
from ipc.prompts import MMItem
from workers.config import ServerConfig
from workers.engine.core.scheduler import SchedulerCore, Sequence

# A hybrid model's groups, named as vLLM names its KV-cache spec kinds.
KV_GROUP = (0, "full_attention")
STATE_GROUP = (1, "mamba")


def image_keys(items: list[MMItem], lo: int, hi: int) -> list[tuple[str, int]] | None:
    """What a block of tokens [lo, hi) hashes besides its tokens (kv_cache.block_hashes): for every image
    it overlaps, the image's content hash and the block's first offset inside the image."""
    keys = [(it.hash.hex(), max(0, lo - it.offset)) for it in sorted(items, key=lambda it: it.offset)
            if it.offset < hi and it.offset + it.length > lo]
    return keys or None


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

    def __init__(self, publisher: KVEventPublisher, block_size: int, medium: str) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.medium = medium
        self.events: list[KVCacheEvent] = []
        self._removed: list[int] = []  # consecutive evictions become one BlockRemoved
        # Hybrid models: KV blocks are group 0, state snapshots group 1 (ipc/kv_events.py); None: one group, unnamed.
        self.kv_group: tuple[int, str] | None = None
        self._snapshots_removed: list[int] = []
        self.published = 0

    @classmethod
    def open(cls, ctx: zmq.Context[Any], config: ServerConfig, replica: int) -> KVEventRecorder | None:
        """Replica ``replica``'s recorder, or None when ``--kv-events-endpoint`` is not set."""
        if not config.kv_events_endpoint:
            return None
        endpoint = replica_endpoint(config.kv_events_endpoint, replica)
        publisher = KVEventPublisher(ctx, endpoint, config.kv_events_topic, replica)
        medium = MEDIUM_GPU if config.engine.device.startswith("cuda") else MEDIUM_CPU
        return cls(publisher, config.engine.block_size, medium)

    def attach(self, core: SchedulerCore) -> KVEventRecorder:
        core.on_blocks_stored = self.stored
        core.allocator.on_evict = self.removed
        if core.state is not None:
            self.kv_group = KV_GROUP
            core.on_snapshot_stored = self.snapshot_stored
            core.state.on_drop = self.snapshot_removed
        self.cleared()  # a new core holds nothing: whatever an earlier run published is gone
        return self

    def stored(self, seq: Sequence, indices: list[int], keys: list[bytes]) -> None:
        self._flush_removed()
        bs, tokens = self.block_size, seq.all_token_ids()
        for run in _runs(indices):
            first, end = run[0], run[-1] + 1
            parent = external_hash(keys[first - 1]) if first > 0 else None
            extra = [image_keys(seq.items, i * bs, (i + 1) * bs) for i in run]
            hashes = [external_hash(keys[i]) for i in run]
            self.events.append(
                block_stored(hashes, parent, tokens[first * bs : end * bs], bs, self.medium, extra, self.kv_group)
            )

    def snapshot_stored(self, seq: Sequence, end: int, key: bytes) -> None:
        """A state snapshot at the end of block [end - bs, end) of ``seq``: a stored block of the state group."""
        self._flush_removed()
        bs, first = self.block_size, end // self.block_size - 1
        parent = external_hash(seq.block_hashes[first - 1]) if first > 0 else None
        extra = [image_keys(seq.items, end - bs, end)]
        tokens = seq.tokens_since(end - bs)[:bs]
        self.events.append(block_stored([external_hash(key)], parent, tokens, bs, self.medium, extra, STATE_GROUP))

    def removed(self, key: bytes) -> None:
        self._removed.append(external_hash(key))

    def snapshot_removed(self, key: bytes) -> None:
        self._snapshots_removed.append(external_hash(key))

    def cleared(self) -> None:
        self._removed.clear()
        self._snapshots_removed.clear()
        self.events.append(AllBlocksCleared())

    def _flush_removed(self) -> None:
        if self._removed:
            group = self.kv_group[0] if self.kv_group is not None else None
            self.events.append(block_removed(self._removed, self.medium, group))
            self._removed = []
        if self._snapshots_removed:
            self.events.append(block_removed(self._snapshots_removed, self.medium, STATE_GROUP[0]))
            self._snapshots_removed = []

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
