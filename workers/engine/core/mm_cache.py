"""Per-image embedding cache, split in two halves that never talk to each other directly.

The *index* (``EmbeddingCacheIndex``) lives with the scheduler: it knows which keys are cached,
their sizes and LRU order, and decides each step which keys to encode and which to evict; with a host tier
(``mm_host_tier.py``) it also decides which evicted entries spill to host memory and which host entries are
reloaded instead of encoded. The
*store* (``EmbeddingStore``) lives in every model worker and holds the tensors; it obeys the
plan's evict and encode lists. Because every rank applies the same lists in the same order, all
ranks hold the same entries and the scheduler can plan without asking anyone.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ipc.prompts import MMItem
from ipc.steps import EncodeItem, EncodeJob
from workers.engine.core.mm_host_tier import HostTierIndex


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


class EmbeddingPlan(NamedTuple):
    """A step's embedding-cache work. Workers apply it in the order StepPlan documents: host evictions, spills,
    evictions, reloads, encodes."""

    evict: list[bytes]  # GPU entries to drop
    encode: list[EncodeJob]
    spill: list[bytes]  # GPU entries to copy into the host tier, then drop from the GPU
    reload: list[bytes]  # host entries to copy back onto the GPU, then drop from the host tier
    host_evict: list[bytes]  # host entries to drop
    # host entries copied onto the GPU for this step only (the GPU tier refused them) and kept in the host tier:
    # with ``reload_refused`` (a split model worker has no tower to encode them instead)
    reload_once: list[bytes]


class EmbeddingCacheIndex:
    """LRU index over the GPU tier's embedding entries, bounded by a byte budget, over an optional host tier
    (``host_budget_bytes`` > 0) that takes what it evicts."""

    def __init__(self, budget_bytes: int, bytes_per_token: int, host_budget_bytes: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # key -> num_tokens, oldest first
        self.used_bytes = 0
        self.stats = CacheStats()
        self.host = HostTierIndex(host_budget_bytes, bytes_per_token)
        self._evicted_tokens: dict[bytes, int] = {}  # sizes of what admit() evicted, for the spill decision
        # Keys a failed step left the workers unsure of: dropped from both tiers at the next plan.
        self._orphans: list[bytes] = []

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
            self._evicted_tokens[old_key] = self._remove(old_key)
            self.stats.evictions += 1
            evicted.append(old_key)
        self._entries[key] = num_tokens
        self.used_bytes += size
        return True, evicted

    def plan(self, needed: dict[bytes, list[MMItem]], reload_refused: bool = False) -> EmbeddingPlan:
        """A step's embedding plan for the keys its chunks read (key -> the items stored under it).

        Hits are pinned first, so admitting a miss never evicts an entry the same step reads. A miss found in the
        host tier is reloaded instead of encoded when the GPU tier admits it (else it is encoded for this step
        only and its host copy stays; with ``reload_refused`` it is copied for this step only instead, as model
        workers without a vision tower need). What admitting evicts spills to the host tier when that tier can keep
        it without evicting an entry this step reloads or has just spilled, and is dropped otherwise."""
        evict, host_evict = list(self._orphans), list(self._orphans)
        self._orphans.clear()
        misses: list[bytes] = []
        pinned: set[bytes] = set()
        for key, items in needed.items():
            hit, stale = self.lookup(key, sum(it.length for it in items))
            if stale is not None:
                evict.append(stale)
            if hit:
                pinned.add(key)
            else:
                misses.append(key)
        jobs: list[EncodeJob] = []
        reload: list[bytes] = []
        reload_once: list[bytes] = []
        evicted: list[bytes] = []
        self._evicted_tokens.clear()
        for key in misses:
            items = needed[key]
            num_tokens = sum(it.length for it in items)
            on_host, stale = self.host.lookup(key, num_tokens)
            if stale is not None:
                host_evict.append(stale)
            admitted, dropped = self.admit(key, num_tokens, pinned)
            evicted.extend(dropped)
            if admitted:
                pinned.add(key)
                if on_host:
                    reload.append(key)
                    self.host.stats.reloads += 1
                    continue
            elif on_host and reload_refused:
                reload_once.append(key)
                self.host.stats.reloads += 1
                continue
            encode = [EncodeItem(it.hash, it.grid, it.length, it.pixels) for it in items]
            jobs.append(EncodeJob(key=key, items=encode, transient=not admitted))
        spill: list[bytes] = []
        host_pinned = {*reload, *reload_once}  # read by this step's reloads, which run after its spills
        for key in evicted:
            if self.host.budget_bytes > 0:
                kept, dropped = self.host.spill(key, self._evicted_tokens[key], host_pinned)
                host_evict.extend(dropped)
                if kept:
                    spill.append(key)
                    host_pinned.add(key)  # a later spill of this step must not evict it before it is written
                    continue
            evict.append(key)
        for key in reload:
            self.host.remove(key)  # the tiers are exclusive: it is a GPU entry again
        return EmbeddingPlan(evict, jobs, spill, reload, host_evict, reload_once)

    def fail_step(self, encoded: list[bytes], spilled: list[bytes], reloaded: list[bytes]) -> None:
        """A step failed on a worker, which may have applied any part of its plan: forget the keys it encoded,
        spilled or reloaded in both tiers, and have the next plan drop them from both stores."""
        for key in [*encoded, *spilled, *reloaded]:
            self.discard(key)
            if key in self.host:
                self.host.remove(key)
            self._orphans.append(key)

    def discard(self, key: bytes) -> None:
        """Forget an entry the workers may not hold (its encode step failed)."""
        if key in self._entries:
            self._remove(key)

    def _remove(self, key: bytes) -> int:
        num_tokens = self._entries.pop(key)
        self.used_bytes -= self.entry_bytes(num_tokens)
        return num_tokens


PAGE_TOKENS = 16  # rows per pool page: at most 15 rows (54 KiB at hidden 3584, bf16) wasted per entry
POOL_SLACK_PAGES = 1024  # room for that waste across 1,024 resident entries: the index counts exact bytes


class EmbeddingStore:
    """Worker-side tensors of the embedding cache, keyed like the index.

    With ``pool_bytes`` (the model worker on CUDA) every cached entry lives in one pool allocated at start-up
    and cut into pages of ``PAGE_TOKENS`` rows; an entry owns a list of pages and eviction hands them back.
    The GPU memory the cache may take is then reserved once, like the KV cache, instead of growing with each
    image the worker has seen (the probe benchmark's peak rose 0.8 GiB over 24 2K images that way).
    Transient entries, and any entry a full pool cannot take, are kept as tensors of their own.
    """

    def __init__(
        self,
        pool_bytes: int = 0,
        hidden: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self._dense: dict[bytes, torch.Tensor] = {}
        self._paged: dict[bytes, tuple[torch.Tensor, list[int]]] = {}  # row index on device, page ids
        self._transient: list[bytes] = []
        page_bytes = PAGE_TOKENS * hidden * torch.empty((), dtype=dtype).element_size()
        pages = -(-pool_bytes // page_bytes) + POOL_SLACK_PAGES if pool_bytes and hidden else 0
        self.pool = torch.empty((pages * PAGE_TOKENS, hidden), dtype=dtype, device=device) if pages else None
        self._free = list(range(pages - 1, -1, -1))  # popped from the end: low pages first
        self.page_bytes = page_bytes
        self.pool_misses = 0  # non-transient entries that found the pool full (kept as their own tensors)

    def __contains__(self, key: bytes) -> bool:
        return key in self._dense or key in self._paged

    def __len__(self) -> int:
        return len(self._dense) + len(self._paged)

    @property
    def nbytes(self) -> int:
        """Bytes held by entries (pages in use count whole)."""
        dense = sum(t.numel() * t.element_size() for t in self._dense.values())
        return dense + sum(len(pages) for _, pages in self._paged.values()) * self.page_bytes

    def evict(self, keys: list[bytes]) -> None:
        for key in keys:
            self._drop(key)

    def put(self, key: bytes, embeddings: torch.Tensor, transient: bool) -> None:
        self._drop(key)
        need = -(-embeddings.shape[0] // PAGE_TOKENS)
        if transient or self.pool is None or need > len(self._free):
            if not transient and self.pool is not None:
                self.pool_misses += 1
            if not transient and embeddings.untyped_storage().nbytes() > embeddings.nbytes:
                # A view (one image of a ViT call's output) would keep the whole output alive, its other images and
                # any padding included, past what the index counts for this entry.
                embeddings = embeddings.clone()
            self._dense[key] = embeddings
        else:
            pages = [self._free.pop() for _ in range(need)]
            rows = _page_rows(pages, embeddings.shape[0], self.pool.device)
            self.pool.index_copy_(0, rows, embeddings.to(self.pool.dtype))
            self._paged[key] = (rows, pages)
        if transient:
            self._transient.append(key)

    def rows(self, key: bytes, first: int, count: int) -> torch.Tensor:
        """Rows ``first : first + count`` of an entry."""
        dense = self._dense.get(key)
        if dense is not None:
            return dense[first : first + count]
        paged = self._paged.get(key)
        if paged is None or self.pool is None:
            raise KeyError(f"embedding {key.hex()[:16]} is not in the store: plan and store disagree")
        return self.pool[paged[0][first : first + count]]

    def num_rows(self, key: bytes) -> int:
        dense = self._dense.get(key)
        if dense is not None:
            return dense.shape[0]
        paged = self._paged.get(key)
        if paged is None:
            raise KeyError(f"embedding {key.hex()[:16]} is not in the store: plan and store disagree")
        return paged[0].shape[0]

    def end_step(self) -> None:
        """Drop entries that were computed for this step only."""
        for key in self._transient:
            self._drop(key)
        self._transient.clear()

    def _drop(self, key: bytes) -> None:
        self._dense.pop(key, None)
        paged = self._paged.pop(key, None)
        if paged is not None:
            self._free.extend(reversed(paged[1]))


def _page_rows(pages: list[int], num_rows: int, device: torch.device) -> torch.Tensor:
    """Pool row of each of an entry's rows, on ``device``, staged through pinned memory: a pageable copy
    would make the host wait for the GPU to drain its stream."""
    pos = torch.arange(num_rows)
    rows = torch.tensor(pages, dtype=torch.int64)[pos // PAGE_TOKENS] * PAGE_TOKENS + pos % PAGE_TOKENS
    if device.type != "cuda":
        return rows.to(device)
    return rows.pin_memory().to(device, non_blocking=True)
