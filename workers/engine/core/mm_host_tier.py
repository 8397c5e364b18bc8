"""Scheduler-side index of the embedding cache's host tier: pinned host memory under the GPU cache.

An entry the GPU cache evicts spills here (device -> host copy) when it fits, instead of being dropped; a later
request for it is a *host hit*, planned as a reload (host -> device copy) rather than a ViT encode. The tiers are
exclusive: a reloaded entry leaves the host tier (it is in the GPU cache again), so each byte of either budget holds
a distinct image.

Eviction is GreedyDual-Size rather than LRU, because what a host entry saves is a re-encode, and re-encodes differ in
cost per byte held. Each entry gets ``priority = clock + cost / size`` when it spills in; the entry with the lowest
priority goes first, and ``clock`` rises to the priority of each entry evicted, so entries that spilled long ago age
out even when their cost per byte is high (with equal cost per byte the rule is plain LRU). ``size`` is the entry's
bytes; ``cost`` is ``tokens + ENCODE_FIXED_TOKENS``: ViT time grows with the image's patches (tokens x merge^2) plus
a per-image fixed part (a ViT call's rotary and window tables, launches), so per byte a small image is dearer to
recompute than a large one, and evicting one large entry makes room for several small ones that would each cost
that fixed part again.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

# The fixed part of one image's re-encode, in token-equivalents of the linear part. An estimate (a 1080p image is
# ~2,700 tokens in ~35 ms on an H200; a ViT call's fixed work is a few ms): it only decides how strongly small
# entries are preferred per byte, never whether an answer is right.
ENCODE_FIXED_TOKENS = 256


@dataclass
class HostTierStats:
    spills: int = 0  # entries copied in from the GPU cache
    hits: int = 0  # lookups that found the entry here
    reloads: int = 0  # entries planned back onto the GPU (a hit the GPU cache could not take is encoded instead)
    evictions: int = 0  # entries dropped to make room (re-encoded if asked for again)
    refused: int = 0  # spills larger than the whole budget: dropped
    token_mismatches: int = 0


def reencode_cost(num_tokens: int) -> int:
    """What re-encoding an entry of ``num_tokens`` tokens costs, in token-equivalents (see the module docstring)."""
    return num_tokens + ENCODE_FIXED_TOKENS


class HostTierIndex:
    """Keys, sizes and GreedyDual-Size priorities of the host tier, bounded by a byte budget."""

    def __init__(self, budget_bytes: int, bytes_per_token: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self.used_bytes = 0
        self.clock = 0.0
        self._entries: dict[bytes, tuple[int, float]] = {}  # key -> (num_tokens, priority)
        # (priority, insertion number, key), lazily deleted: an item is live while the entry still has that priority.
        self._heap: list[tuple[float, int, bytes]] = []
        self._inserted = 0
        self.stats = HostTierStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def report(self) -> dict[str, int]:
        """The tier's numbers, named as SchedulerStats' ``mm_host_cache_*`` fields."""
        return {
            "mm_host_cache_budget_bytes": self.budget_bytes,
            "mm_host_cache_bytes": self.used_bytes,
            "mm_host_cache_entries": len(self._entries),
            "mm_host_cache_hits": self.stats.hits,
            "mm_host_cache_spills": self.stats.spills,
            "mm_host_cache_reloads": self.stats.reloads,
            "mm_host_cache_evictions": self.stats.evictions,
        }

    def priority(self, key: bytes) -> float:
        return self._entries[key][1]

    def lookup(self, key: bytes, num_tokens: int) -> tuple[bool, bytes | None]:
        """Return (hit, key_to_drop). As in the GPU index, a size that disagrees with the request's is a miss and
        the entry is dropped (the workers must drop it too)."""
        cached = self._entries.get(key)
        if cached is None:
            return False, None
        if cached[0] != num_tokens:
            self.stats.token_mismatches += 1
            self.remove(key)
            return False, key
        self.stats.hits += 1
        return True, None

    def spill(self, key: bytes, num_tokens: int, pinned: set[bytes]) -> tuple[bool, list[bytes]]:
        """Take an entry the GPU cache evicts; returns (kept, host keys evicted for it). ``pinned``: host entries this
        step reloads, which must still be readable while the spill is written. An entry that cannot fit is dropped."""
        if key in self._entries:  # (tiers are exclusive, so only after a failed step's bookkeeping)
            self.remove(key)
        size = num_tokens * self.bytes_per_token
        evictable = sum(n * self.bytes_per_token for k, (n, _) in self._entries.items() if k not in pinned)
        if size > self.budget_bytes or self.used_bytes - evictable + size > self.budget_bytes:
            self.stats.refused += 1
            return False, []
        evicted: list[bytes] = []
        skipped: list[tuple[float, int, bytes]] = []
        while self.used_bytes + size > self.budget_bytes:
            item = heapq.heappop(self._heap)
            prio, _, old = item
            entry = self._entries.get(old)
            if entry is None or entry[1] != prio:
                continue  # a stale heap item: the entry left or re-entered since
            if old in pinned:
                skipped.append(item)
                continue
            self.clock = prio  # GreedyDual's aging: later entries start from the evicted one's priority
            self.remove(old)
            self.stats.evictions += 1
            evicted.append(old)
        for item in skipped:
            heapq.heappush(self._heap, item)
        prio = self.clock + reencode_cost(num_tokens) / size
        self._entries[key] = (num_tokens, prio)
        self._inserted += 1
        heapq.heappush(self._heap, (prio, self._inserted, key))
        self.used_bytes += size
        self.stats.spills += 1
        return True, evicted

    def remove(self, key: bytes) -> None:
        num_tokens, _ = self._entries.pop(key)
        self.used_bytes -= num_tokens * self.bytes_per_token
        if len(self._heap) > 4 * len(self._entries) + 64:  # keep stale items from piling up
            self._heap = [(p, i, k) for p, i, k in self._heap if self._entries.get(k, (0, None))[1] == p]
            heapq.heapify(self._heap)
