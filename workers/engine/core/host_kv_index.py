"""Scheduler-side index of the host-RAM tier under the prefix cache's KV blocks.

The host pool (in the model workers) holds ``num_slots`` KV blocks in the device cache's per-layer block layout.
This index decides which chained block key lives in which host slot, so every TP rank applies the same copy lists:

- spill: a freed device block that still carries a registered key is about to be handed out again (its contents
  overwritten). Its key goes to a host slot (a free one, or the least recently used one) and the pair
  ``(device block, host slot)`` is queued for the step's ``kv_spill`` list.
- load: a prompt whose prefix misses the device cache but hits here gets fresh device blocks; the pairs
  ``(host slot, device block)`` go to the step's ``kv_load`` list and those tokens count as cached.

Ordering within one step (workers): every spill, then every load, then the forward. A slot read by a load queued
this step is pinned, so no spill of the same step overwrites it before it is read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class HostCopies:
    """One step's copies, with the keys they move (kept by the core until the step's result, so a failed step can
    forget exactly what it may have left half done)."""

    spill: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    load: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    spilled: list[tuple[bytes, int]] = field(default_factory=list)  # (key, host slot) per spill
    loaded: list[tuple[bytes, int]] = field(default_factory=list)  # (key, device block) per load


class HostKVIndex:
    """Chained block key -> host slot, least recently used first; the copies queued for the next step."""

    def __init__(self, num_slots: int, block_size: int) -> None:
        if num_slots <= 0 or block_size <= 0:
            raise ValueError("num_slots and block_size must be positive")
        self.num_slots = num_slots
        self.block_size = block_size
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # oldest used first
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()  # slots read by a load queued for the coming step
        self._copies = HostCopies()
        self.spills = 0  # blocks copied device -> host
        self.loads = 0  # blocks copied host -> device
        self.hit_tokens = 0  # prompt tokens served from the host tier (their prefill skipped)
        # KV events (workers/scheduler/kv_events.py): a key that comes to live on the host, and one that leaves it.
        self.on_stored: Callable[[bytes], None] | None = None
        self.on_removed: Callable[[bytes], None] | None = None

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    @property
    def pending(self) -> HostCopies:
        """The copies queued for the next plan (read only)."""
        return self._copies

    def contains(self, digest: bytes) -> bool:
        return digest in self._slot_of

    def spill(self, block: int, digest: bytes) -> int | None:
        """Queue device ``block`` (registered under ``digest``, about to be reused) for a copy to a host slot.

        Returns the slot, or None when no copy is needed (the key is already on the host: a block loaded back
        earlier keeps its host copy, so it is stored once) or possible (every slot pinned by this step's loads).
        """
        if digest in self._slot_of:
            self._slot_of.move_to_end(digest)
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._slot_of[digest] = slot
        self._copies.spill.append((block, slot))
        self._copies.spilled.append((digest, slot))
        self.spills += 1
        if self.on_stored is not None:
            self.on_stored(digest)
        return slot

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for digest, slot in self._slot_of.items():  # oldest first; a pinned slot is read this step
            if slot not in self._pinned:
                del self._slot_of[digest]
                if self.on_removed is not None:
                    self.on_removed(digest)
                return slot
        return None

    def match(self, hashes: list[bytes]) -> list[int]:
        """Host slots holding the longest prefix of ``hashes`` (no side effects)."""
        slots = []
        for digest in hashes:
            slot = self._slot_of.get(digest)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def pin(self, slots: list[int]) -> None:
        """Keep ``slots`` from being reused by a spill until the step's copies are taken."""
        self._pinned.update(slots)

    def queue_load(self, hashes: list[bytes], slots: list[int], blocks: list[int]) -> None:
        """Copy host ``slots`` (found by ``match`` for ``hashes``) into fresh device ``blocks`` before the forward."""
        for digest, slot, block in zip(hashes, slots, blocks, strict=True):
            self._slot_of.move_to_end(digest)
            self._copies.load.append((slot, block))
            self._copies.loaded.append((digest, block))
        self._pinned.update(slots)
        self.loads += len(blocks)
        self.hit_tokens += len(blocks) * self.block_size

    def drain(self) -> HostCopies:
        """The copies queued since the last drain, for the plan being built (cleared here); pins end with it."""
        copies, self._copies = self._copies, HostCopies()
        self._pinned.clear()
        return copies

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (spill, load) lists, cleared here; pins end with the step."""
        copies = self.drain()
        return copies.spill, copies.load

    def forget(self, spilled: list[tuple[bytes, int]]) -> None:
        """Spills of a step that failed: the workers may not have written those slots. Each key goes if it still
        lives in the slot its spill named (a later step may have given the slot to another key already)."""
        for digest, slot in spilled:
            if self._slot_of.get(digest) == slot:
                del self._slot_of[digest]
                self._free_slots.append(slot)
                if self.on_removed is not None:
                    self.on_removed(digest)


REPORT_FIELDS = (
    "kv_host_cache_slots_total",
    "kv_host_cache_slots_used",
    "kv_host_cache_spilled_blocks",  # blocks copied device -> host
    "kv_host_cache_loaded_blocks",  # blocks copied host -> device
    "kv_host_cache_hit_tokens",  # prompt tokens those loads spared the prefill
)


def kv_host_report(index: HostKVIndex | None) -> dict[str, int]:
    """The tier's numbers, named as SchedulerStats' ``kv_host_cache_*`` fields (zeros when it is off)."""
    if index is None:
        return dict.fromkeys(REPORT_FIELDS, 0)
    values = (index.num_slots, index.num_used, index.spills, index.loads, index.hit_tokens)
    return dict(zip(REPORT_FIELDS, values, strict=True))
