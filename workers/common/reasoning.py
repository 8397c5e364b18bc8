"""Reasoning output (``--reasoning-parser``): a thinking model's answer split into its reasoning and its content.

Qwen3 / Qwen3.5 / Qwen3.6 and DeepSeek-R1 write their reasoning between ``<think>`` and ``</think>``, then the answer.
Their chat templates often open ``<think>`` themselves (Qwen3.5 does unless ``enable_thinking`` is false), so the
output starts inside the reasoning and carries only the end marker: the tokenizer says which (``opens_inside``), from
the rendered prompt's end. Where the prompt did not open it, a start marker counts only before any other text (a
model that mentions ``<think>`` mid-answer is answering).

The split is incremental, as the scheduler hands on each step's text: a piece that could be the start of a marker is
held back until the next text (or the end) shows whether it is one, so a marker cut across two steps is still found
and never leaks into either part. Whitespace right after a marker is dropped, as the templates write a newline there.

``tokens`` counts the completion tokens of the reasoning (usage's ``completion_tokens_details.reasoning_tokens``): a
token counts when its text arrives inside the reasoning or opens it, so the start marker's tokens and the end
marker's count, and the text held before a start marker counts once the marker shows.
"""

from __future__ import annotations

from workers.common.tools import partial_tail

# parser name -> (start marker, end marker); the names are vLLM's.
PARSERS: dict[str, tuple[str, str]] = {
    "qwen3": ("<think>", "</think>"),
    "deepseek_r1": ("<think>", "</think>"),
}


def opens_inside(parser: str, prompt_text: str) -> bool:
    """Whether a prompt rendered as ``prompt_text`` leaves its answer inside the reasoning (it ends with the start
    marker, as Qwen3.5's template writes ``<think>\\n`` after the assistant's header)."""
    return parser in PARSERS and prompt_text.rstrip().endswith(PARSERS[parser][0])


class ReasoningSplit:
    """One choice's output through a parser: ``step`` returns the (reasoning, content) of each piece of text."""

    def __init__(self, parser: str, inside: bool) -> None:
        self.start, self.end = PARSERS[parser]
        self.state = "reasoning" if inside else "before"  # before -> reasoning -> content
        self.held = ""  # text not yet placed: a possible marker prefix, or leading whitespace before a start marker
        self.trim = inside  # drop whitespace at the head of the part that just began
        self.tokens = 0  # completion tokens of the reasoning so far
        self._pending = 0  # tokens whose text is held before a possible start marker

    def step(self, text: str, finished: bool, tokens: int = 1) -> tuple[str, str]:
        """(reasoning, content) of the next ``text``, which came from ``tokens`` sampled tokens."""
        was = self.state
        parts = self._split(text, finished)
        if "reasoning" in (was, self.state):
            self.tokens += self._pending + tokens
            self._pending = 0
        elif self.state == "before":
            self._pending += tokens
        else:
            self._pending = 0
        return parts

    def _split(self, text: str, finished: bool) -> tuple[str, str]:
        text = self.held + text
        self.held = ""
        reasoning = content = ""
        if self.state == "before":
            stripped = text.lstrip()
            if stripped.startswith(self.start):
                self.state, self.trim = "reasoning", True
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

