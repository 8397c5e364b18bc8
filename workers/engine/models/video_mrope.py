"""M-RoPE positions for Qwen2.5-VL prompts with videos (images too), as transformers' ``get_rope_index``.

Qwen2.5-VL lays a whole video out as one block of vision tokens: its frame groups follow each other inside
one vision_start/vision_end pair, every group on the same h/w coordinates (offset by the position P where
the video starts) and group g at temporal coordinate P + trunc(g * tokens_per_second * second_per_grid_t),
which the tokenizer computes once per group (``Frame``'s second value). glimpse keeps each group its own
media item (encoded, cached and split across prefill chunks on its own), so a group whose frame index is
above 0 continues the video of the group before it.

Where text resumes after a video follows transformers 5 (the reference these tests compare with): at
P + max(h, w) of the merged grid, as for an image, whatever the video's temporal extent; and decoded tokens
continue from the prompt's last position (``generate`` steps the last position ids by one), so the decode
delta is that of the text's cursor. transformers 4 and vLLM resume text (and decoding) after the video's
largest coordinate instead; the two agree while a video's temporal extent stays within its spatial one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from workers.engine.models.base import Span


def _layout(spans: Sequence[Span], merge: int) -> Iterator[tuple[int, int, int, int, int, int, int, int]]:
    """Per span: (text tokens before it, base position P, temporal offset, t, merged h, merged w, the position
    text resumes at after it, the span's end), with P the position its h/w rows start from (a video's start
    for every group of that video)."""
    pos = cursor = 0
    start: int | None = None  # P of the video whose groups are being laid out
    for offset, length, (t, h, w), frame in spans:
        if offset < cursor:
            raise ValueError("image spans overlap or are not sorted")
        gh, gw = h // merge, w // merge
        if t * gh * gw != length:
            raise ValueError(f"span of {length} tokens does not match grid {(t, h, w)} with merge {merge}")
        text = offset - cursor
        if frame is not None and frame[0] > 0:
            if start is None or text:
                raise ValueError(f"frame group {frame[0]} does not directly follow its video's previous group")
            base = start
        else:
            base = pos + text
            start = base if frame is not None else None
        pos = base + (max(gh, gw) if frame is not None else max(t, gh, gw))
        cursor = offset + length
        yield text, base, frame[1] if frame is not None else 0, t, gh, gw, pos, cursor


def video_mrope_positions(num_tokens: int, spans: Sequence[Span], merge: int) -> tuple[list[list[int]], int]:
    """The 3 x num_tokens position rows and the decode delta (see the module docstring)."""
    rows: list[list[int]] = [[], [], []]
    pos = cursor = 0
    for text, base, tpos, t, gh, gw, after, end in _layout(spans, merge):
        for row in rows:
            row.extend(range(pos, pos + text))
        for ti in range(t):
            for hi in range(gh):
                rows[0].extend([base + tpos + ti] * gw)
                rows[1].extend([base + hi] * gw)
                rows[2].extend(range(base, base + gw))
        pos, cursor = after, end
    tail = num_tokens - cursor
    for row in rows:
        row.extend(range(pos, pos + tail))
    return rows, pos + tail - num_tokens


def video_mrope_delta(num_tokens: int, spans: Sequence[Span], merge: int) -> int:
    """``video_mrope_positions``' delta alone, in O(spans)."""
    pos = cursor = 0
    for *_, after, end in _layout(spans, merge):
        pos, cursor = after, end
    return pos - cursor
