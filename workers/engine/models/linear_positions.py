"""Plain 1-D positions for families without M-RoPE (Gemma 4): every token, text or image, advances one position.

The runner's step inputs carry three position rows for every family; here the three rows are equal, and the
decode delta is 0 (a decoded token at index p sits at position p).
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.engine.models.base import Span


def linear_positions(num_tokens: int, spans: Sequence[Span], merge: int) -> tuple[list[list[int]], int]:
    """Three equal rows 0..num_tokens-1 and delta 0 (``spans`` and ``merge`` do not move positions here)."""
    row = list(range(num_tokens))
    return [row, list(row), list(row)], 0


def linear_delta(num_tokens: int, spans: Sequence[Span], merge: int) -> int:
    return 0
