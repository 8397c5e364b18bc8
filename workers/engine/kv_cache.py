"""Paged KV cache bookkeeping on the scheduling side: a block allocator and slot arithmetic.

The tensors themselves live in the model worker; the scheduler only hands out block ids. A
sequence's ``block_table`` maps its token index ``p`` to slot ``block_table[p // block_size] *
block_size + p % block_size``.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockAllocator:
    """Hands out KV blocks from a free list. Block ids are 0..num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self._used:
                raise ValueError(f"block {block} freed twice or never allocated")
            self._used.remove(block)
            self._free.append(block)


def slot_mapping(block_table: list[int], start: int, length: int, block_size: int) -> list[int]:
    """Cache slots of tokens [start, start + length) of a sequence."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + length)]
