"""The byte ranges of an encoder worker's CUDA landing pool (workers/encoder/cuda_landing.py): first fit over a
sorted list of free ranges, offsets aligned, neighbours merged on free. Pure Python, no torch: the pool holds a few
dozen entries of megabytes each, so a list scan is cheaper than anything cleverer and easy to check.
"""

from __future__ import annotations

import bisect

# Every range starts on this boundary: any dtype's view of it is aligned, and copies run at full width.
ALIGN = 256


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


class RangeAllocator:
    """Ranges of ``[0, size)`` handed out by ``carve`` and taken back by ``free``."""

    def __init__(self, size: int, align: int = ALIGN) -> None:
        if size < 0 or align <= 0 or align & (align - 1):
            raise ValueError(f"a pool of {size} bytes aligned to {align}")
        self.size = size - size % align  # a tail shorter than one alignment unit can hold nothing aligned
        self.align = align
        self._free: list[tuple[int, int]] = [(0, self.size)] if self.size else []  # (offset, length), sorted
        self._used: dict[int, int] = {}  # offset -> length carved

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        return list(self._free)

    def carve(self, nbytes: int) -> int | None:
        """The offset of a fresh range of at least ``nbytes`` (rounded up to the alignment), or None when no free
        range is long enough (the caller lands the entry elsewhere)."""
        if nbytes <= 0:
            raise ValueError(f"cannot carve {nbytes} bytes")
        need = align_up(nbytes, self.align)
        for i, (offset, length) in enumerate(self._free):
            if length < need:
                continue
            if length == need:
                del self._free[i]
            else:
                self._free[i] = (offset + need, length - need)
            self._used[offset] = need
            return offset
        return None

    def free(self, offset: int) -> None:
        """Give back the range carved at ``offset``, merged with the free ranges it touches."""
        length = self._used.pop(offset, None)
        if length is None:
            raise KeyError(f"no range carved at offset {offset}")
        i = bisect.bisect_left(self._free, (offset, 0))
        end = offset + length
        if i < len(self._free) and self._free[i][0] == end:  # the free range right after it
            end += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == offset:  # the free range right before it
            offset = self._free[i - 1][0]
            self._free[i - 1] = (offset, end - offset)
        else:
            self._free.insert(i, (offset, end - offset))
