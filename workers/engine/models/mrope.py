"""M-RoPE positions for Qwen2.5-VL prompts.

Text tokens advance one position at a time on all three rows (t, h, w). An image's tokens take
(t, h, w) coordinates on its merged grid, offset by the position where the image starts, and the
text after it resumes at start + max(t, h, w): the same rule as transformers' ``get_rope_index``.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.engine.models.base import Span


def mrope_positions(num_tokens: int, spans: Sequence[Span], merge: int) -> tuple[list[list[int]], int]:
    """Return the 3 x num_tokens position rows and the decode delta.

    ``spans`` holds (offset, length, (t, h, w) in patches, frame) per image, sorted by offset. The delta
    is what a decoded token at index p adds to p to get its (equal on all rows) position. A video's frame
    group is laid out as an image (families whose prompts separate groups with timestamp text: Qwen3-VL).
    """
    rows: list[list[int]] = [[], [], []]
    pos = 0
    cursor = 0
    for offset, length, (t, h, w), *_ in spans:
        if offset < cursor:
            raise ValueError("image spans overlap or are not sorted")
        text = range(pos, pos + offset - cursor)
        for row in rows:
            row.extend(text)
        pos += offset - cursor
        gh, gw = h // merge, w // merge
        if t * gh * gw != length:
            raise ValueError(f"span of {length} tokens does not match grid {(t, h, w)} with merge {merge}")
        for ti in range(t):
            for hi in range(gh):
                rows[0].extend([pos + ti] * gw)
                rows[1].extend([pos + hi] * gw)
                rows[2].extend(range(pos, pos + gw))
        pos += max(t, gh, gw)
        cursor = offset + length
    tail = range(pos, pos + num_tokens - cursor)
    for row in rows:
        row.extend(tail)
    pos += num_tokens - cursor
    return rows, pos - num_tokens


def mrope_delta(num_tokens: int, spans: Sequence[Span], merge: int) -> int:
    """``mrope_positions``' delta alone, in O(images): a text token advances one position, an image's span
    advances max(t, h, w) of its merged grid."""
    pos = cursor = 0
    for offset, length, (t, h, w), *_ in spans:
        if offset < cursor:
            raise ValueError("image spans overlap or are not sorted")
        pos += offset - cursor + max(t, h // merge, w // merge)
        cursor = offset + length
    return pos + num_tokens - cursor - num_tokens
