"""The sliding-window layers' own KV block group (Gemma 4): a second pool whose blocks a sequence gives back once
they fall wholly before every later query's window.

A family with sliding-window layers (``ModelSpec.kv_windows``) keeps two block groups. The global layers use the
main allocator and a sequence's ``block_table``, every block kept as long as the sequence lives. The sliding layers'
caches are a pool of their own, indexed through ``Sequence.window_table``: entry i holds block i's keys and values
for those layers, or ``SENTINEL`` once no query can see it again (a query at position p sees keys j > p - window,
so block i is dead for every query from ``start`` on once ``(i + 1) * block_size <= start - window + 1``). The
worker reads a sentinel as its scratch block; the mask never lets a query see what is there.

Window blocks are taken chunk by chunk (a long prompt never needs its whole length in this pool), released when a
chunk is planned, and, full and computed, registered under the same chained keys as the global blocks, so a released
block stays a prefix-cache hit until the allocator recycles it. A step planned ahead may release blocks the step in
flight still reads: the pool hands them out again in the next step at the earliest, whose writes run after the
step in flight's reads (one stream, steps in order).
"""

from __future__ import annotations

from workers.engine.core.kv_cache import BlockAllocator
from workers.engine.core.sequence import Sequence

SENTINEL = -1  # a window-table entry whose block went back to the pool (the worker's scratch block)


class WindowBlocks:
    """The block group of the sliding-window layers: its allocator and the rules of a sequence's window table."""

    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        if window <= 0:
            raise ValueError("a window block group needs a positive window")
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.window = window
        self.block_size = block_size
        self.released = 0  # blocks given back before their sequence ended (stats, tests)

    def stats(self) -> dict[str, int]:
        return {
            "window_blocks_total": self.allocator.num_blocks,
            "window_blocks_used": self.allocator.num_used,
            "window_blocks_released": self.released,
        }

    def first_needed(self, start: int) -> int:
        """The first block a query at ``start`` (or later) can still see."""
        return max(0, start - self.window + 1) // self.block_size

    def per_sequence(self, chunk: int) -> int:
        """Most window blocks one sequence holds while it computes chunks of up to ``chunk`` tokens: the blocks of
        the window before a chunk, the chunk's, and one for the block boundaries they may straddle."""
        return -(-(self.window + chunk) // self.block_size) + 1

    def release(self, seq: Sequence, start: int) -> None:
        """Give back the sequence's blocks that no query from ``start`` on can see."""
        table = seq.window_table
        dead = [i for i in range(min(self.first_needed(start), len(table))) if table[i] != SENTINEL]
        if dead:
            self.allocator.free([table[i] for i in dead])
            for i in dead:
                table[i] = SENTINEL
            self.released += len(dead)

    def need(self, seq: Sequence, end: int) -> int:
        """Blocks the sequence still has to take for tokens up to ``end``."""
        return max(0, self.allocator.blocks_for(end) - len(seq.window_table))

    def extend(self, seq: Sequence, end: int) -> None:
        """Take the blocks for tokens up to ``end`` (the caller checked that they are free)."""
        seq.window_table.extend(self.allocator.allocate(self.need(seq, end)))

    def free_all(self, seq: Sequence) -> None:
        """The sequence ends or loses its KV: every window block it holds goes back."""
        held = [b for b in seq.window_table if b != SENTINEL] + seq.window_fork_blocks
        if held:
            self.allocator.free(held)
        seq.window_table, seq.window_fork_blocks, seq.sent_window_blocks = [], [], 0

    def prefix(self, hashes: list[bytes], depth: int) -> tuple[int, list[int]]:
        """The deepest hit at most ``depth`` blocks deep whose next query finds every window block it needs here
        (a window block may have been recycled while its global block is still cached), and those blocks: a window
        table for the hit, sentinels before the window."""
        for d in range(depth, 0, -1):
            lo = self.first_needed(d * self.block_size)
            blocks = [self.allocator.lookup(h) for h in hashes[lo:d]]
            if all(b is not None for b in blocks):
                return d, [SENTINEL] * lo + [b for b in blocks if b is not None]
        return 0, []

    def acquire(self, table: list[int]) -> None:
        self.allocator.acquire([b for b in table if b != SENTINEL])

    def reusable_free(self, table: list[int]) -> int:
        return self.allocator.reusable_free([b for b in table if b != SENTINEL])

    def register(self, seq: Sequence, first: int, full: int, hashes: list[bytes]) -> None:
        """Publish the sequence's full computed window blocks ``first..full-1`` that it still holds."""
        table = seq.window_table
        for i in range(first, min(full, len(table))):
            if table[i] != SENTINEL:
                self.allocator.register(table[i], hashes[i])
