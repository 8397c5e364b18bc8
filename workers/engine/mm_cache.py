"""Per-image embedding cache, split in two halves that never talk to each other directly.

The *index* (``EmbeddingCacheIndex``) lives with the scheduler: it knows which keys are cached,
their sizes and LRU order, and decides each step which keys to encode and which to evict. The
*store* (``EmbeddingStore``) lives in every model worker and holds the tensors; it obeys the
plan's evict and encode lists. Because every rank applies the same lists in the same order, all
ranks hold the same entries and the scheduler can plan without asking anyone.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0  # entries larger than what the cache can hold: encoded for one step only
    token_mismatches: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class EmbeddingCacheIndex:
    """LRU index over embedding entries, bounded by a byte budget."""

    def __init__(self, budget_bytes: int, bytes_per_token: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # key -> num_tokens, oldest first
        self.used_bytes = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def entry_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token

    def lookup(self, key: bytes, num_tokens: int) -> tuple[bool, bytes | None]:
        """Return (hit, key_to_evict). A hit refreshes the entry's LRU position.

        Every hit checks the token count: an entry whose size disagrees with what the request
        expects (a hash collision, or a processor setting that changed the grid) is dropped and
        reported as a miss, so wrong embeddings are never spliced into a prompt.
        """
        cached = self._entries.get(key)
        if cached is None:
            self.stats.misses += 1
            return False, None
        if cached != num_tokens:
            self.stats.token_mismatches += 1
            self.stats.misses += 1
            self._remove(key)
            return False, key
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return True, None

    def admit(self, key: bytes, num_tokens: int, pinned: set[bytes]) -> tuple[bool, list[bytes]]:
        """Make room for and insert ``key``; returns (admitted, evicted keys).

        Entries in ``pinned`` (needed by the step being planned) are never evicted. An entry larger
        than the whole budget, or one that cannot fit without evicting pinned entries, is refused:
        the caller then encodes it for this step only.
        """
        size = self.entry_bytes(num_tokens)
        if size > self.budget_bytes:
            self.stats.refused += 1
            return False, []
        evictable = sum(self.entry_bytes(n) for k, n in self._entries.items() if k not in pinned)
        if self.used_bytes - evictable + size > self.budget_bytes:
            self.stats.refused += 1
            return False, []
        evicted: list[bytes] = []
        for old_key in list(self._entries):
            if self.used_bytes + size <= self.budget_bytes:
                break
            if old_key in pinned:
                continue
            self._remove(old_key)
            self.stats.evictions += 1
            evicted.append(old_key)
        self._entries[key] = num_tokens
        self.used_bytes += size
        return True, evicted

    def discard(self, key: bytes) -> None:
        """Forget an entry the workers may not hold (its encode step failed)."""
        if key in self._entries:
            self._remove(key)

    def _remove(self, key: bytes) -> None:
        num_tokens = self._entries.pop(key)
        self.used_bytes -= self.entry_bytes(num_tokens)


class EmbeddingStore:
    """Worker-side tensors of the embedding cache, keyed like the index."""

    def __init__(self) -> None:
        self._entries: dict[bytes, torch.Tensor] = {}
        self._transient: list[bytes] = []

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._entries.values())

    def evict(self, keys: list[bytes]) -> None:
        for key in keys:
            self._entries.pop(key, None)

    def put(self, key: bytes, embeddings: torch.Tensor, transient: bool) -> None:
        self._entries[key] = embeddings
        if transient:
            self._transient.append(key)

    def get(self, key: bytes) -> torch.Tensor:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"embedding {key.hex()[:16]} is not in the store: plan and store disagree") from None

    def end_step(self) -> None:
        """Drop entries that were computed for this step only."""
        for key in self._transient:
            self._entries.pop(key, None)
        self._transient.clear()
