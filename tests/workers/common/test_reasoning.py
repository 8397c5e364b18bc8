"""The reasoning split (--reasoning-parser) on text markers: markers found whatever way the text arrives in pieces,
the reasoning's tokens counted, and where the answer starts (a generation prompt's end, a continued message)."""

from __future__ import annotations

import pytest

from workers.common.reasoning import ReasoningSplit
from workers.common.reasoning_markers import opens_inside
from workers.tokenizer.requests.chat import ChatCompletionRequest, Message, TextPart
from workers.tokenizer.requests.reasoning import continued_text


def counted(pieces: list[str], inside: bool, parser: str = "qwen3") -> tuple[str, str, int]:
    """Each piece as one sampled token's text -> (reasoning, content, reasoning tokens)."""
    s = ReasoningSplit(parser, inside)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = s.step(i, piece, 0, i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content, s.tokens


def split(pieces: list[str], inside: bool, parser: str = "qwen3") -> tuple[str, str]:
    return counted(pieces, inside, parser)[:2]


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
    # Gemma 4: a template that forces thinking opens the channel with its name; the thinking-off one closes it.
    assert opens_inside("gemma4", "<|turn>model\n<|channel>thought\n")
    assert not opens_inside("gemma4", "<|turn>model\n<|channel>thought\n<channel|>")


def test_reasoning_tokens_are_those_from_the_start_marker_through_the_end_marker() -> None:
    # "<th" is held as the marker's beginning, then counted with the token that completes it; "</think>" counts.
    assert counted(["<th", "ink>", "a", " b", "</think>", "\n\nc", "d"], inside=False) == ("a b", "cd", 5)
    assert counted(["Let", " me", "</", "think>", "\n", "It"], inside=True) == ("Let me", "It", 4)
    assert counted(["No", " reasoning", " here"], inside=False) == ("", "No reasoning here", 0)
    assert counted(["<", "b>", "old"], inside=False) == ("", "<b>old", 0)  # held, but no marker: content
    assert counted(["all", " thought"], inside=True) == ("all thought", "", 2)  # cut inside the reasoning


def chat(last: Message, continued: bool = True) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="demo", messages=[Message("user", "hi"), last], continue_final_message=continued,
                                 add_generation_prompt=not continued)


def test_a_continued_assistant_message_that_opened_the_reasoning_starts_inside() -> None:
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    opened = chat(Message("assistant", "<think>\nLet me see"))
    closed = chat(Message("assistant", "<think>\nEasy.\n</think>\n\nIt is"))
    for request, inside in ((opened, True), (closed, False)):
        text = request.messages[-1].content
        assert isinstance(text, str)
        continued = continued_text(request, prompt + text.strip())
        assert continued == text and opens_inside("qwen3", prompt + text, continued) is inside
    # the message's last text part is what the prompt ends with
    parts = chat(Message("assistant", [TextPart("<think>\nHmm")]))
    assert opens_inside("qwen3", "", continued_text(parts, prompt + "<think>\nHmm"))
    # Not continued, or the template rewrote the message: the generation prompt's end decides, as before.
    assert continued_text(chat(Message("assistant", "<think>\nx"), continued=False), prompt) is None
    assert continued_text(opened, prompt + "rewritten") is None


def test_reasoning_tokens_are_the_tokens_up_to_the_end_marker() -> None:
    # The start marker's pieces, the reasoning and the end marker count; the answer does not.
    assert counted(["<th", "ink>", "\nTwo", " plus", " two", ".\n", "</think>", "\n\nIt", " is", " 4."], False)[2] == 7
    assert counted(["Two", " plus", " two", "</think>", "It", " is 4."], True)[2] == 4  # the template opened it
    assert counted(["Two", " plus"], True)[2] == 2  # cut inside the reasoning: all of it
    assert counted(["The", " answer", " is 4."], False)[2] == 0
    assert counted([" ", "<thi", "s is", " fine"], False)[2] == 0  # text that only looked like a marker's start
    # the whole reasoning in one piece of text (a stop string held it back): the token that let it out counts
    assert counted(["<think>x</think>", "y"], False) == ("x", "y", 1)
