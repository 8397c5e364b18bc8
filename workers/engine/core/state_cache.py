"""The linear-attention state pool of a hybrid model, on the scheduling side: which slot holds what.

A hybrid model (Qwen3.5: Gated DeltaNet layers beside full attention) keeps, per sequence and per linear-attention
layer, a conv window and a recurrent matrix instead of KV. The model worker reserves a pool of such states at
start-up; here each slot is either free, the *live* state of one running sequence, or a *snapshot*: the state of some
sequence right after a block boundary, published under that block's prefix key (kv_cache.block_hashes), so a later
request whose prefix (text and images) matches resumes from the deepest snapshot instead of from zero. KV blocks
alone cannot give a hybrid model a prefix hit: the recurrent layers need the state at exactly that point.

Snapshots are a cache: a live sequence that needs a slot takes the least recently used snapshot's, and a snapshot
goes when its block leaves the KV prefix cache (``drop``). A snapshot planned in a step is *pending* until the
step's result comes back (``publish``), as KV blocks are registered only once computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

# A hybrid model's prefill chunks end at multiples of this many prompt tokens (chunking.ChunkSizing._on_grid): the
# chunked gated delta kernels (flash-linear-attention's) cut each sequence of a step into 64-token chunks from its
# first new token and keep the state at every chunk start, so a step's snapshots at block boundaries (multiples of the
# block size) come out of one kernel pipeline only when every piece starts on such a multiple. A piece starting
# elsewhere cuts the layer's call at each snapshot (a pipeline and its gathers per cut: on the Qwen3.5-27B shape
# 2.85 pipelines a layer at 4,096-token steps).
CHUNK_ALIGN = 64


class OutOfStateSlots(RuntimeError):
    """A live state slot was asked for while every slot holds a live sequence or a pending snapshot."""


class StatePool:
    """Slots 0..num_slots-1 of the model workers' state pools."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("a hybrid model needs at least one state slot")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: low slots first
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # published, least recently used first
        self._pending: dict[int, bytes] = {}  # slot -> key of a snapshot being computed
        self.live = 0
        self.snapshots_taken = 0
        self.snapshots_evicted = 0
        self.restores = 0  # admissions that started from a snapshot
        self.restored_tokens = 0  # prompt tokens those restores skipped
        self.on_drop: Callable[[bytes], None] | None = None  # a published snapshot is gone (KV-cache events)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def available(self) -> int:
        """Slots a live sequence could take now: free ones and published snapshots (evicted on demand)."""
        return len(self._free) + len(self._snapshots)

    def allocate(self, n: int = 1) -> list[int]:
        """``n`` live slots, evicting the least recently used snapshots if the free ones run out."""
        if n > self.available:
            raise OutOfStateSlots(f"asked for {n} state slots, {self.available} available")
        out = []
        for _ in range(n):
            if not self._free:
                self._evict_oldest()
            out.append(self._free.pop())
        self.live += n
        return out

    def release(self, slots: list[int]) -> None:
        """Live slots whose sequences ended or lost their state (preempted)."""
        for slot in slots:
            if not 0 <= slot < self.num_slots or slot in self._free:
                raise ValueError(f"state slot {slot} released twice or never allocated")
            self._free.append(slot)
        self.live -= len(slots)

    # ---- snapshots ------------------------------------------------------------------------------
    def lookup(self, key: bytes) -> int | None:
        """The slot of the published snapshot under ``key`` (without touching its recency)."""
        return self._snapshots.get(key)

    def use(self, key: bytes, tokens: int) -> int:
        """A request resumes from the snapshot under ``key``, skipping ``tokens`` prompt tokens: its slot, now the
        most recently used."""
        self._snapshots.move_to_end(key)
        self.restores += 1
        self.restored_tokens += tokens
        return self._snapshots[key]

    def wanted(self, key: bytes) -> bool:
        """Whether a snapshot under ``key`` is worth planning: none is published or being computed."""
        return key not in self._snapshots and key not in self._pending.values()

    def reserve(self, key: bytes) -> int | None:
        """A slot for a snapshot to be computed under ``key``: a free one, else the least recently used snapshot's
        (newer prefixes are likelier to be asked for again); None when every slot is live or pending."""
        if not self._free and not self._snapshots:
            return None
        if not self._free:
            self._evict_oldest()
        slot = self._free.pop()
        self._pending[slot] = key
        return slot

    def pending_key(self, slot: int) -> bytes:
        return self._pending[slot]

    def publish(self, slot: int) -> bool:
        """The step that computed a pending snapshot has come back: later requests may resume from it. False when
        another sequence published the same prefix meanwhile (the slot is freed)."""
        key = self._pending.pop(slot)
        if key in self._snapshots:
            self._free.append(slot)
            return False
        self._snapshots[key] = slot
        self.snapshots_taken += 1
        return True

    def cancel(self, slot: int) -> None:
        """A pending snapshot whose step failed: its slot is free again, its contents unknown."""
        self._pending.pop(slot)
        self._free.append(slot)

    def drop(self, key: bytes) -> None:
        """The KV block under ``key`` left the prefix cache: a snapshot there can never be matched again."""
        slot = self._snapshots.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            self.snapshots_evicted += 1
            if self.on_drop is not None:
                self.on_drop(key)

    def stats(self) -> dict[str, int]:
        """The pool's numbers, named as SchedulerStats' ``state_*`` fields."""
        return {
            "state_slots_total": self.num_slots,
            "state_slots_live": self.live,
            "state_snapshots": self.num_snapshots,
            "state_snapshots_taken": self.snapshots_taken,
            "state_snapshots_evicted": self.snapshots_evicted,
            "state_restores": self.restores,
            "state_restored_tokens": self.restored_tokens,
        }

    def _evict_oldest(self) -> None:
        key, slot = self._snapshots.popitem(last=False)
        self._free.append(slot)
        self.snapshots_evicted += 1
        if self.on_drop is not None:
            self.on_drop(key)


def snapshot_points(start: int, end: int, prompt_len: int, block_size: int, every: int) -> list[int]:
    """Block boundaries in (start, end] where a prompt's state is worth a snapshot: every ``every`` blocks (0: none
    of those), and the last boundary before the prompt's final token (a chat's next turn, or the same prompt again,
    resumes there; the final token itself is always computed, for its logits)."""
    last = (prompt_len - 1) // block_size * block_size
    points = []
    if every > 0:
        step = every * block_size
        points = list(range((start // step + 1) * step, min(end, last) + 1, step))
    if start < last <= end and last not in points:
        points.append(last)
    return points
