"""The reasoning split (--reasoning-parser): markers found whatever way the text arrives in pieces."""

from __future__ import annotations

import pytest

from workers.common.reasoning import ReasoningSplit, opens_inside


def split(pieces: list[str], inside: bool, parser: str = "qwen3") -> tuple[str, str]:
    s = ReasoningSplit(parser, inside)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = s.step(piece, i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


WHOLE = "<think>\nLet me count: 2 + 2.\n</think>\n\nIt is 4."


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(WHOLE)])
def test_markers_are_found_however_the_text_is_cut(size: int) -> None:
    pieces = [WHOLE[i : i + size] for i in range(0, len(WHOLE), size)]
    assert split(pieces, inside=False) == ("Let me count: 2 + 2.\n", "It is 4.")
    opened = WHOLE.removeprefix("<think>\n")  # the template opened it: only the end marker comes
    assert split([opened[i : i + size] for i in range(0, len(opened), size)], inside=True) == (
        "Let me count: 2 + 2.\n", "It is 4.")


def test_an_answer_cut_inside_its_reasoning_is_all_reasoning() -> None:
    assert split(["Hmm, let me ", "think about </th"], inside=True) == ("Hmm, let me think about </th", "")


def test_without_markers_everything_is_content() -> None:
    assert split(["The answer", " is 4."], inside=False) == ("", "The answer is 4.")
    # a start marker after other text is part of the answer
    assert split(["Use the <think> tag."], inside=False) == ("", "Use the <think> tag.")
    # text that began like a marker but was not one comes back whole, as written
    assert split(["  <thi", "s is fine"], inside=False) == ("", "  <this is fine")


def test_the_prompt_end_says_whether_the_answer_starts_inside() -> None:
    assert opens_inside("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not opens_inside("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_inside("qwen3", "<|im_start|>assistant\n")
    assert opens_inside("deepseek_r1", "<｜Assistant｜><think>\n")


def count(tokens: list[str], inside: bool) -> int:
    """Reasoning tokens of an answer sampled as ``tokens`` (one piece of text per token)."""
    s = ReasoningSplit("qwen3", inside)
    for i, token in enumerate(tokens):
        s.step(token, i == len(tokens) - 1)
    return s.tokens


def test_reasoning_tokens_are_the_tokens_up_to_the_end_marker() -> None:
    # The start marker's pieces, the reasoning and the end marker count; the answer does not.
    assert count(["<th", "ink>", "\nTwo", " plus", " two", ".\n", "</think>", "\n\nIt", " is", " 4."], False) == 7
    assert count(["Two", " plus", " two", "</think>", "It", " is 4."], True) == 4  # the template opened it
    assert count(["Two", " plus"], True) == 2  # cut inside the reasoning: all of it
    assert count(["The", " answer", " is 4."], False) == 0
    assert count([" ", "<thi", "s is", " fine"], False) == 0  # text that only looked like a marker's start
