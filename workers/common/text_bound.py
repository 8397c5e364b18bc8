"""The most text a prompt of ``max_model_len`` tokens can hold, so a longer one is refused before the chat template
and the tokenizer see all of it (a tokenizer worker for generations, the HTTP process for /tokenize)."""

from __future__ import annotations

from typing import Any

# Unicode normalization (NFC/NFKC, which tokenizers apply first) composes at most four code points
# into one (a Greek vowel with three marks), so text of c characters is at least c / 4 after it.
NORMALIZATION_SHRINK = 4


def max_text_chars(tokenizer: Any, max_model_len: int) -> int:
    """``max_model_len`` tokens of the longest vocabulary entry's UTF-8 length (no token covers more bytes of text:
    byte-level entries spell one byte per character, and encode to at least that many), before normalization."""
    longest = max((len(t.encode()) for t in tokenizer.get_vocab()), default=1) or 1
    return max_model_len * longest * NORMALIZATION_SHRINK
