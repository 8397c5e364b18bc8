"""Reasoning output (``--reasoning-parser``): a thinking model's answer split into its reasoning and its content.

Qwen3 / Qwen3.5 / Qwen3.6 and DeepSeek-R1 write their reasoning between ``<think>`` and ``</think>``, then the answer.
Their chat templates often open ``<think>`` themselves (Qwen3.5 does unless ``enable_thinking`` is false), so the
output starts inside the reasoning and carries only the end marker: the tokenizer says which (``opens_inside``), from
the rendered prompt's end. Where the prompt did not open it, a start marker counts only before any other text (a
model that mentions ``<think>`` mid-answer is answering).

The split is incremental, as the scheduler hands on each step's text: a piece that could be the start of a marker is
held back until the next text (or the end) shows whether it is one, so a marker cut across two steps is still found
and never leaks into either part. Whitespace right after a marker is dropped, as the templates write a newline there.

Gemma 4 (``gemma4``) marks its reasoning with special tokens (``<|channel>thought`` ... ``<channel|>``), which the
detokenizer drops: its split works on token ids (reasoning_channels.py); ``make_split`` picks the kind.

Both count ``reasoning_tokens`` (usage.completion_tokens_details): the sampled tokens that belong to the reasoning,
its markers included.
"""

from __future__ import annotations

from typing import Protocol

from workers.common.detokenizer import TextStream
from workers.common.reasoning_channels import ChannelSplit
from workers.common.reasoning_markers import PARSERS
from workers.common.tools import partial_tail


class Split(Protocol):
    """One choice's split, as the scheduler's results path drives it (workers/scheduler/results.py)."""

    tokens: int  # reasoning tokens so far

    def cuts(self, token_id: int | None) -> bool:
        """Whether the detokenizer must hand on all text before ``token_id`` now (a marker token's boundary)."""
        ...

    def step(self, token_id: int | None, text: str, decoded: int, finished: bool) -> tuple[str, str]:
        """The sampled token (None: none this step) and the text the stream let out for it -> (reasoning, content).
        ``decoded``: characters the detokenizer has produced so far, this token's included (before stop strings)."""
        ...


def make_split(parser: str, inside: bool, marker_ids: tuple[int, int] | None) -> Split:
    """The split of ``parser``; ``marker_ids`` (start, end) for a parser whose markers are special tokens."""
    if PARSERS[parser].special:
        assert marker_ids is not None, f"--reasoning-parser {parser} needs the ids of its marker tokens"
        return ChannelSplit(PARSERS[parser], marker_ids, inside)
    return ReasoningSplit(parser, inside)


def split_text(
    stream: TextStream, split: Split | None, token_id: int | None, finish_reason: str | None
) -> tuple[str, str, str | None]:
    """One sampled token (None: the core ended the choice without one) through a choice's text stream and its split
    (None: no parser) -> (reasoning, content, finish reason), as ``TextStream.add`` and ``Split.step`` take them."""
    cut = split is not None and split.cuts(token_id)  # a marker token: the text before it, whole, now
    text, reason = stream.add(token_id, finish_reason, cut)
    if split is None:
        return "", text, reason
    reasoning, content = split.step(token_id, text, stream.decoded, reason is not None)
    return reasoning, content, reason


class ReasoningSplit:
    """One choice's output through a text-marker parser: ``step`` returns the (reasoning, content) of each piece.

    Tokens are counted as reasoning by when their text is placed (the split works on text, which lags the tokens
    only where the detokenizer or a stop string holds some back): a token counts when the split was inside the
    reasoning as its text arrived, or when its text completed the start marker (with the tokens before it whose
    text was held back as that marker's beginning). The token whose text holds the end marker counts, as it arrives
    inside; those after it are content."""

    def __init__(self, parser: str, inside: bool) -> None:
        self.start, self.end = PARSERS[parser][:2]
        self.state = "reasoning" if inside else "before"  # before -> reasoning -> content
        self.held = ""  # text not yet placed: a possible marker prefix, or leading whitespace before a start marker
        self.trim = inside  # drop whitespace at the head of the part that just began
        self.tokens = 0
        self.unplaced = 0  # tokens whose text is held as a possible start marker's beginning
        self.opened = False  # the last step's text held the start marker

    def cuts(self, token_id: int | None) -> bool:
        return False

    def step(self, token_id: int | None, text: str, decoded: int = 0, finished: bool = False) -> tuple[str, str]:
        was, self.opened = self.state, False
        sampled = 0 if token_id is None else 1
        reasoning, content = self._place(text, finished)
        if was == "reasoning":
            self.tokens += sampled
        elif self.opened:  # this text completed the start marker
            self.tokens += self.unplaced + sampled
        self.unplaced = self.unplaced + sampled if self.state == "before" else 0
        return reasoning, content

    def _place(self, text: str, finished: bool) -> tuple[str, str]:
        text = self.held + text
        self.held = ""
        reasoning = content = ""
        if self.state == "before":
            stripped = text.lstrip()
            if stripped.startswith(self.start):
                self.state, self.trim, self.opened = "reasoning", True, True
                text = stripped[len(self.start):]
            elif self.start.startswith(stripped) and not finished:
                self.held = text  # whitespace and maybe a marker's beginning: wait for more
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            cut = text.find(self.end)
            if cut >= 0:
                reasoning, text = text[:cut], text[cut + len(self.end):]
                self.state = "content"
                reasoning, self.trim = self._head(reasoning), True
            else:
                keep = 0 if finished else partial_tail(text, self.end)
                reasoning, self.held = self._head(text[: len(text) - keep]), text[len(text) - keep:]
                return reasoning, ""
        content = self._head(text)
        return reasoning, content

    def _head(self, text: str) -> str:
        """``text``, without its leading whitespace while the part it belongs to has shown none yet."""
        if self.trim:
            text = text.lstrip()
            self.trim = not text
        return text
