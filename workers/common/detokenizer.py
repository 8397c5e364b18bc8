"""Incremental detokenization and stop strings for streamed outputs (runs in the scheduler process).

Text is produced token by token, so two things can go wrong that a final ``decode`` never sees:
a multi-byte UTF-8 character split over several byte-level BPE tokens (the partial tail decodes
to U+FFFD), and a stop string split over several deltas. ``IncrementalDetokenizer`` holds text back
until it is whole; ``StopChecker`` holds back text that might still grow into a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
# An incomplete UTF-8 character has at most 3 bytes, and every byte-level token carries at least one: a window whose
# decode still ends in U+FFFD with more tokens pending than this holds bytes that no later token can complete.
MAX_PENDING_TOKENS = 3


class Decoder(Protocol):
    """The part of a Hugging Face tokenizer this module uses (HF's decode also takes batches,
    hence the loose types)."""

    def decode(self, token_ids: Any, skip_special_tokens: bool = ..., **kwargs: Any) -> Any: ...


def special_ids(tokenizer: object) -> frozenset[int]:
    """What ``skip_special_tokens`` skips: the tokenizer's special tokens and its added tokens marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    ids |= {i for i, t in decoder.items() if getattr(t, "special", False)}
    return frozenset(ids)


class IncrementalDetokenizer:
    """Turns one request's sampled tokens into text deltas, one ``push`` per step.

    Each call decodes a short window, not the whole output: ``ids[prefix:read]`` is the last text
    already emitted (kept as left context, because some tokenizers decode a token differently at
    the start of a string than in the middle), ``ids[read:]`` the tokens not yet emitted. The new
    text is the window's decode minus the context's decode. While the window's decode ends in
    U+FFFD the tail may be an incomplete character, so only what lies before its last ``MAX_PENDING_TOKENS`` tokens
    can be emitted: a model that samples invalid bytes (a stray continuation byte, say) would otherwise hold its
    stream back until valid text comes, seconds later.
    """

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Special tokens kept in the text while the others are skipped (a tool-call format's tags): the others are
        # dropped before an unskipping decode.
        self._drop = special_ids(tokenizer) - keep if keep and skip_special_tokens else frozenset()
        self.token_ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens before this index have been emitted as text

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self.token_ids[start:end]
        if self._drop:
            return str(self._tokenizer.decode([t for t in ids if t not in self._drop], skip_special_tokens=False))
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip))

    def push(self, token_ids: Iterable[int]) -> str:
        """Add sampled tokens; return the text that became complete (may be "")."""
        self.token_ids.extend(token_ids)
        if len(self.token_ids) == self._read:
            return ""
        window = self._decode(self._prefix)
        if not window.endswith(REPLACEMENT_CHAR):
            return self._advance(window)
        settled = len(self.token_ids) - MAX_PENDING_TOKENS
        if settled <= self._read:
            return ""
        # The text up to `settled` is final if the whole window agrees with it: a character cut at `settled` that
        # later tokens complete decodes differently there (U+FFFD against the character) and is held.
        head = self._decode(self._prefix, settled)
        return self._advance(head, settled) if window.startswith(head) else ""

    def flush(self) -> str:
        """At the end of the request: whatever is still held back, even an incomplete character
        (the model really did stop there, so U+FFFD is the honest rendering)."""
        if len(self.token_ids) == self._read:
            return ""
        return self._advance(self._decode(self._prefix))

    def _advance(self, window: str, end: int | None = None) -> str:
        """Emit ``window`` (the decode of ids[prefix:end]) past the context; ``end`` defaults to every token."""
        # The context is decoded only here, when text is emitted: held-back steps cost one decode.
        context = self._decode(self._prefix, self._read) if self._read > self._prefix else ""
        # Byte-level BPE always decodes the window to context + new text. A tokenizer whose clean-up
        # rules rewrite the context once more tokens follow gets "everything after the common
        # prefix": best effort, since text already streamed cannot be taken back.
        if window.startswith(context):
            delta = window[len(context) :]
        else:
            common = 0
            for a, b in zip(context, window):
                if a != b:
                    break
                common += 1
            delta = window[common:]
        self._prefix, self._read = self._read, len(self.token_ids) if end is None else end
        return delta


class StopChecker:
    """Applies stop strings to a stream of text deltas.

    ``push`` returns (text safe to emit, matched). Text that could be the start of a stop string is
    held back until the next delta decides it; on a match the output is cut right before the stop
    string, which is never emitted, and later pushes return nothing. ``flush`` releases what was held
    back once the request ends for another reason (length, EOS).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        # Empty stop strings would match everywhere; OpenAI treats them as absent.
        self.stops = tuple(s for s in dict.fromkeys(stops) if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.matched = False
        self.matched_stop: str | None = None  # the stop string that matched (vLLM's stop_reason)

    def push(self, delta: str) -> tuple[str, bool]:
        if self.matched:
            return "", True
        if not self.stops:
            return delta, False
        text = self._held + delta
        # A stop that ends inside this delta began at most len(stop) - 1 chars before it, and those
        # chars were held back, so searching held + delta finds every new match.
        hits = [(i, n) for n, i in enumerate(text.find(s) for s in self.stops) if i >= 0]
        if hits:
            at, which = min(hits)  # the earliest in the text; of two starting there, the first given
            self.matched, self.matched_stop = True, self.stops[which]
            self._held = ""
            return text[:at], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched else held


class TextStream:
    """One request's output: detokenizer, then stop strings, plus the usage counts."""

    def __init__(
        self,
        tokenizer: Decoder,
        stops: Sequence[str],
        prompt_tokens: int = 0,
        skip_special_tokens: bool = True,
        keep: frozenset[int] = frozenset(),
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, keep)
        self.stop = StopChecker(stops)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.decoded = 0  # characters the detokenizer has let out (before stop strings): a reasoning split's offsets

    def push(self, token_id: int, cut: bool = False) -> tuple[str, bool]:
        """Add one sampled token; returns (text delta, a stop string matched). ``cut``: the token is a boundary
        (a reasoning marker token), so the text of the tokens so far is let out whole now, an incomplete
        character included, rather than held for tokens after it."""
        self.completion_tokens += 1
        delta = self.detok.push((token_id,))
        if cut:
            delta += self.detok.flush()
        self.decoded += len(delta)
        return self.stop.push(delta)

    def add(self, token_id: int | None, finish_reason: str | None, cut: bool = False) -> tuple[str, str | None]:
        """One sampled token (None: the core ended the request without one) and the scheduling core's verdict
        for it -> (text delta, finish reason); ``cut`` as in ``push``.

        A stop-string match finishes the request with "stop" even where the core would go on (the
        caller then tells the core); a request the core finished releases the held-back text."""
        text, matched = self.push(token_id, cut) if token_id is not None else ("", False)
        if finish_reason is not None and not matched:
            tail, matched = self.finish()
            text += tail
        return text, "stop" if matched else finish_reason

    def finish(self) -> tuple[str, bool]:
        """The request ended for another reason (length, stop token): release the held-back text,
        which still has to pass the stop strings. Returns (last text, a stop string matched)."""
        last = self.detok.flush()
        self.decoded += len(last)
        tail, matched = self.stop.push(last)
        return (tail, True) if matched else (tail + self.stop.flush(), False)

    def stop_reason(self, token_id: int | None, finish_reason: str | None) -> str | int | None:
        """What stopped a choice that finished with "stop", as vLLM's ``stop_reason`` names it: the stop string that
        matched, or the last token where it is one of the request's ``stop_token_ids``; None for an end-of-sequence
        token (and for any other finish)."""
        if finish_reason != "stop":
            return None
        if self.stop.matched_stop is not None:
            return self.stop.matched_stop
        return token_id if token_id in self.stop_token_ids else None
