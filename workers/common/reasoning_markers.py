"""Reasoning markers of each ``--reasoning-parser`` and where a prompt leaves the answer (inside the reasoning or not).

Kept apart from the splits (reasoning.py for text markers, reasoning_channels.py for marker tokens) so both, the
tokenizer and the CLI read the table without importing each other.
"""

from __future__ import annotations

from typing import NamedTuple


class Markers(NamedTuple):
    start: str
    end: str
    special: bool = False  # the markers are special tokens: split on token ids (reasoning_channels.py)
    channel: str = ""  # a name the format writes right after the start marker (Gemma 4's "thought"), dropped


# parser name -> its markers; the names are vLLM's.
PARSERS: dict[str, Markers] = {
    "qwen3": Markers("<think>", "</think>"),
    "deepseek_r1": Markers("<think>", "</think>"),
    "gemma4": Markers("<|channel>", "<channel|>", special=True, channel="thought"),
}


def opens_inside(parser: str, prompt_end: str, continued: str | None = None) -> bool:
    """Whether a prompt leaves its answer inside the reasoning.

    ``prompt_end``: the rendered prompt's end (the template's generation prompt), which opens the reasoning when it
    ends with the start marker (Qwen3.5 writes ``<think>\\n`` after the assistant's header; a Gemma 4 template that
    forces thinking, ``<|channel>thought\\n``). ``continued``: with ``continue_final_message``, the assistant message
    the answer continues, as the prompt ends with it: inside when it opened the reasoning and did not close it."""
    if parser not in PARSERS:
        return False
    start, end, _, channel = PARSERS[parser]
    if continued is not None:
        at = continued.rfind(start)
        return at >= 0 and end not in continued[at:]
    tail = prompt_end.rstrip()
    return tail.endswith(start) or bool(channel) and tail.endswith(start + channel)
