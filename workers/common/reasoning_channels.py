"""The reasoning split on marker tokens (``--reasoning-parser gemma4``).

Gemma 4 thinks in a channel: ``<|channel>thought\\n`` reasoning ``<channel|>`` answer, where ``<|channel>`` and
``<channel|>`` are special tokens (ids 100 and 101 in the Hub vocabulary; the demo's differ). The detokenizer drops
special tokens (skip_special_tokens), so the markers never reach the text: the split sees the sampled ids instead.
A marker token marks a boundary at the detokenizer's output so far (``decoded``): the stream is asked to hand on all
text before a marker at once (``cuts``), so the boundary falls between whole characters. The text the stream lets
out (after stop strings, which may hold some back a while) is then placed by those boundaries, so streamed pieces
join to what the whole answer splits into, however the steps cut it.

Special tokens cannot come from text by chance, so each marker counts wherever it comes: a start marker opens a
block even after some content, an end marker closes it (one with no block open is content, dropped as any special
token). The channel's name right after the start marker (``thought``, then a newline) is dropped, as is whitespace
at the head of a part that a marker began, as the text split does; a reasoning block's text is held back until the
name is known (at most its length and one more character).

reasoning_tokens counts exactly by token: a start marker, every token sampled inside a block, and the end marker that
closes it; tokens before a block or after its end marker are content. A prompt that opened the block (a template
forcing thinking) makes the answer's first tokens reasoning.
"""

from __future__ import annotations

from collections import deque

from workers.common.reasoning_markers import PARSERS, Markers


def marker_ids(tokenizer: object, markers: Markers) -> tuple[int, int]:
    """The ids of the (start, end) marker tokens in ``tokenizer``'s vocabulary; ValueError naming what is missing
    when either is not one special token there (the split could not see it, or would see its text)."""
    vocab: dict[str, int] = tokenizer.get_vocab()  # type: ignore[attr-defined]
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    special |= {str(t) for t in decoder.values() if getattr(t, "special", False)}
    missing = [m for m in (markers.start, markers.end) if m not in vocab or m not in special]
    if missing:
        raise ValueError(f"the tokenizer has no special token {' or '.join(missing)}")
    return vocab[markers.start], vocab[markers.end]


def check_markers(parser: str, model: str) -> None:
    """At start-up: a parser whose markers are special tokens needs them in the checkpoint's tokenizer; a one-line
    ValueError says which are missing (a checkpoint of another family, or a tokenizer without Gemma 4's tokens)."""
    markers = PARSERS.get(parser)
    if markers is None or not markers.special:
        return
    from transformers import AutoTokenizer

    try:
        marker_ids(AutoTokenizer.from_pretrained(model), markers)
    except ValueError as exc:
        raise ValueError(f"--reasoning-parser {parser} splits on the special tokens {markers.start} and "
                         f"{markers.end}, but {exc} ({model})") from None


class ChannelSplit:
    """One choice's output through a token-marker parser (workers/common/reasoning.py ``Split``)."""

    def __init__(self, markers: Markers, ids: tuple[int, int], inside: bool) -> None:
        self.start_id, self.end_id = ids
        self.channel = markers.channel
        self.inside = inside  # where the next sampled token lands
        # Boundaries not yet reached by the placed text: (offset in the detokenized text, reasoning from there).
        self.bounds: deque[tuple[int, bool]] = deque()
        self.reasoning = inside  # the part the next placed character belongs to
        self.placed = 0  # characters of the stream's text placed so far
        self.naming = inside  # a block began: its channel name may still come (its text is held)
        self.held = ""
        self.trim = inside  # drop whitespace at the head of the part that just began
        self.tokens = 0

    def cuts(self, token_id: int | None) -> bool:
        return token_id == self.start_id or token_id == self.end_id and self.inside

    def step(self, token_id: int | None, text: str, decoded: int, finished: bool) -> tuple[str, str]:
        if token_id == self.start_id:
            self.tokens += 1
            self.inside = True
            self.bounds.append((decoded, True))
        elif token_id == self.end_id and self.inside:
            self.tokens += 1
            self.inside = False
            self.bounds.append((decoded, False))
        elif token_id is not None and self.inside:
            self.tokens += 1
        out: tuple[list[str], list[str]] = ([], [])  # (content, reasoning) pieces
        while True:
            while self.bounds and self.bounds[0][0] <= self.placed:
                self._enter(self.bounds.popleft()[1], out)
            if not text:
                break
            n = len(text) if not self.bounds else min(len(text), self.bounds[0][0] - self.placed)
            self._put(text[:n], out)
            text, self.placed = text[n:], self.placed + n
        if finished and self.naming:
            self._named(True, out)
        return "".join(out[1]), "".join(out[0])

    def _enter(self, reasoning: bool, out: tuple[list[str], list[str]]) -> None:
        """A boundary reached: the part that ends gives up what it held; the next one begins."""
        if self.naming:
            self._named(True, out)
        self.reasoning, self.naming, self.trim = reasoning, reasoning, True

    def _put(self, text: str, out: tuple[list[str], list[str]]) -> None:
        if self.naming:
            self.held += text
            self._named(False, out)
            return
        if self.trim:
            text = text.lstrip()
            self.trim = not text
        out[self.reasoning].append(text)

    def _named(self, final: bool, out: tuple[list[str], list[str]]) -> None:
        """Drop the channel's name from the held head of a block once it is known (``final``: the block or answer
        ended, so what is held is all there is): the name alone, or the name and whitespace; anything else stays."""
        held, name = self.held, self.channel
        if not final and len(held) <= len(name) and name.startswith(held):
            return  # may still be the name, or the name and its newline
        if held == name or held.startswith(name) and held[len(name)].isspace():
            held = held[len(name):]
        self.held, self.naming = "", False
        if held:
            self._put(held, out)
