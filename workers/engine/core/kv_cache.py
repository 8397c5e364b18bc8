"""Paged KV cache bookkeeping on the scheduling side: a block allocator with prefix caching, and
slot arithmetic.

The tensors themselves live in the model worker; the scheduler only hands out block ids. A
sequence's ``block_table`` maps its token index ``p`` to slot ``block_table[p // block_size] *
block_size + p % block_size``.

Prefix caching: a *full* block whose K/V has been computed is registered under the chained hash of
every token up to its end. A later request whose prompt starts with the same tokens shares those
blocks (reference counted) and skips their prefill. A block's key carries the full content hash of every
image it overlaps (see ``block_hashes``), so two prompts share a block only if they show the same images there. Freed
blocks keep their registration until the allocator hands them out again, oldest freed first, so
the cache costs no memory the engine could otherwise use.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import blake3

from ipc.prompts import MMItem

if TYPE_CHECKING:
    from workers.engine.core.host_kv_index import HostKVIndex


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    limit: int | None = None,
    known: list[bytes] | None = None,
    items: Sequence[MMItem] = (),
) -> list[bytes]:
    """Chained 128-bit keys of the full blocks of ``token_ids`` (at most ``limit`` of them), extending the
    already computed ``known`` prefix of them in place when given.

    A block's key is blake3(parent key, the block's token ids as little-endian int64, and for every image span
    the block overlaps: the image's full 16-byte content hash and the block's first offset inside the image).
    Image tokens hold pad values derived from 30 bits of the image hash, which an attacker can collide in
    seconds; the key carries the whole hash, so two different images never share a block. The layout is
    documented in README ("Prefix-cache keys") for routers that want to reproduce it.
    """
    out: list[bytes] = known if known is not None else []
    full = len(token_ids) // block_size if limit is None else min(limit, len(token_ids) // block_size)
    prev = out[-1] if out else b""
    spans = sorted(items, key=lambda it: it.offset)
    first = 0  # first span that may still overlap the current block (blocks go left to right)
    for i in range(len(out), full):
        lo, hi = i * block_size, (i + 1) * block_size
        h = blake3.blake3(prev)
        h.update(array("q", token_ids[lo:hi]).tobytes())
        while first < len(spans) and spans[first].offset + spans[first].length <= lo:
            first += 1
        for span in spans[first:]:
            if span.offset >= hi:
                break
            h.update(span.hash)
            h.update(max(0, lo - span.offset).to_bytes(8, "little"))
        prev = h.digest(16)
        out.append(prev)
    return out


class BlockAllocator:
    """Hands out KV blocks 0..num_blocks-1; blocks are reference counted and may be shared."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest freed first
        self._refs = [0] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.prefix_hit_tokens = 0
        # Called with a key whose block is recycled (its registration ends): KV-cache events' BlockRemoved.
        self.on_evict: Callable[[bytes], None] | None = None
        # Called first with the same key: a hybrid model's state snapshot kept under it goes with the block.
        self.on_unregister: Callable[[bytes], None] | None = None
        # Host-RAM tier under the prefix cache: a registered block is spilled there before it is overwritten.
        self.host: HostKVIndex | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Registered blocks (in use or free but still reusable)."""
        return len(self._by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            digest = self._hash_of.pop(block, None)
            if digest is not None:  # recycled: its old contents are about to be overwritten
                del self._by_hash[digest]
                if self.host is not None:
                    self.host.spill(block, digest)
                if self.on_unregister is not None:
                    self.on_unregister(digest)
                if self.on_evict is not None:
                    self.on_evict(digest)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def load_from_host(self, hashes: list[bytes]) -> list[int]:
        """Fresh device blocks for the longest prefix of ``hashes`` held by the host tier, registered under those
        keys, with their host -> device copies queued; ``hashes`` start where the device match ended."""
        if self.host is None:
            return []
        slots = self.host.match(hashes)[: len(self._free)]
        if not slots:
            return []
        self.host.pin(slots)  # the spills this allocation triggers must not overwrite the slots read here
        blocks = self.allocate(len(slots))
        self.host.queue_load(hashes[: len(slots)], slots, blocks)
        for block, digest in zip(blocks, hashes, strict=False):
            self.register(block, digest)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop a reference on each of ``blocks`` (a block table, in prompt order); a block left unreferenced joins
        the free list's recent end, still registered. Tail first: the free list recycles its oldest end first, so a
        finished prompt's last blocks go before its first ones, and a returning conversation still finds its prefix
        (a hit is a prefix: with the head recycled first, the tail left on the device is unreachable)."""
        for block in reversed(blocks):
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} freed twice or never allocated")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    # ---- prefix caching -------------------------------------------------------------------------
    def match(self, hashes: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes`` (no side effects)."""
        blocks = []
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def lookup(self, digest: bytes) -> int | None:
        """The block registered under ``digest``, if any (no side effects)."""
        return self._by_hash.get(digest)

    def is_cached(self, digest: bytes) -> bool:
        """Whether a block is registered under ``digest``."""
        return digest in self._by_hash

    def reusable_free(self, blocks: list[int]) -> int:
        """How many of ``blocks`` would leave the free list if acquired."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks found by ``match``."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        self.prefix_hit_tokens += len(blocks) * self.block_size

    def share(self, blocks: list[int]) -> None:
        """One more reference on blocks in use (an n > 1 request's choices share its prompt blocks)."""
        for block in blocks:
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} is not in use")
            self._refs[block] += 1

    def unregister(self, block: int, digest: bytes) -> None:
        """End ``block``'s registration under ``digest`` if it still holds it (its contents cannot be trusted: the
        host-tier load that was to fill it failed), as a recycle would: the key is no longer on the device."""
        if self._hash_of.get(block) != digest:
            return
        del self._hash_of[block], self._by_hash[digest]
        if self.on_unregister is not None:
            self.on_unregister(digest)
        if self.on_evict is not None:
            self.on_evict(digest)

    def register(self, block: int, digest: bytes) -> bool:
        """Publish a full, computed block under its prefix hash (first writer wins); whether it was published."""
        if digest not in self._by_hash and block not in self._hash_of:
            self._by_hash[digest] = block
            self._hash_of[block] = digest
            return True
        return False


def slot_mapping(block_table: list[int], start: int, length: int, block_size: int) -> list[int]:
    """Cache slots of tokens [start, start + length) of a sequence: a range per block (per token, a 4,096-token
    chunk took 0.77 ms of the model worker's host time, by ranges 0.16)."""
    out: list[int] = []
    p, end = start, start + length
    while p < end:
        i, off = divmod(p, block_size)
        stop = min(end, p - off + block_size)
        first = block_table[i] * block_size + off
        out.extend(range(first, first + stop - p))
        p = stop
    return out
