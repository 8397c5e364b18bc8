"""Log probabilities in OpenAI's shape: token ids from the model worker become token text and bytes
(runs in the scheduler process, which holds the tokenizer).

A byte-level BPE token may be part of a UTF-8 character; its ``bytes`` are the raw bytes it stands for
(what OpenAI's field is for), and its ``token`` text decodes them with U+FFFD for the incomplete part.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from ipc.messages import SampleLogprobs, TokenLogprob, TopLogprob

# JSON has no -inf; OpenAI (and vLLM) report a token that cannot be sampled with this value.
FLOOR = -9999.0


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: byte-level BPE writes byte b as chars[b]."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class LogprobRenderer:
    """Turns ``SampleLogprobs`` into ``TokenLogprob`` entries; token text and bytes are cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        table = _byte_decoder()
        raw: bytes
        if isinstance(piece, str) and piece and all(ch in table for ch in piece):
            raw = bytes(table[ch] for ch in piece)
        else:  # an added or special token (or a tokenizer that is not byte-level): its text is its bytes
            raw = str(self.tokenizer.decode([token_id], skip_special_tokens=False)).encode()
        entry = (raw.decode("utf-8", errors="replace"), list(raw))
        self._cache[token_id] = entry
        return entry

    def render(self, token_id: int, lp: SampleLogprobs) -> TokenLogprob:
        text, raw = self.token(token_id)
        top = []
        for tid, value in zip(lp.top_ids, lp.top_logprobs, strict=True):
            t, b = self.token(tid)
            top.append(TopLogprob(t, _finite(value), b))
        return TokenLogprob(text, _finite(lp.logprob), raw, top)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR
