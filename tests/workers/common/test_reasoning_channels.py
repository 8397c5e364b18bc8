"""--reasoning-parser gemma4: the split on Gemma 4's channel marker tokens, driven as the scheduler drives it
(``split_text``: one sampled id per step through the choice's TextStream, skip_special_tokens on, then the split) with
the Gemma 4 demo tokenizer's real ids. The markers are special tokens the detokenizer drops, so these prove the split
finds them by id: the reasoning is the decoded tokens between them without the channel's name, the content the rest,
however stop strings and incomplete characters hold text back across a marker; the steps' pieces join to what the
whole id sequence splits into (what streaming and non-streaming answers are made of); and reasoning_tokens counts
the start marker, the tokens inside and the end marker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from workers.common.detokenizer import TextStream
from workers.common.reasoning import make_split, split_text
from workers.common.reasoning_channels import check_markers, marker_ids
from workers.common.reasoning_markers import PARSERS

GEMMA4 = PARSERS["gemma4"]


@pytest.fixture(scope="module")
def tok() -> Any:
    from workers.engine.models.gemma4.demo_tokenizer import train_gemma_tokenizer

    return train_gemma_tokenizer()[0]


def ids_of(tok: Any, *parts: str | int) -> list[int]:
    """Text parts tokenized, int parts (marker ids) as they are."""
    out: list[int] = []
    for part in parts:
        out.extend([part] if isinstance(part, int) else tok.encode(part, add_special_tokens=False))
    return out


def run(tok: Any, ids: list[int], inside: bool = False, stops: tuple[str, ...] = ()) -> tuple[list[tuple[str, str]], int]:
    """Each id as one step, the last finishing the choice -> (each step's (reasoning, content), reasoning tokens)."""
    stream = TextStream(tok, stops)
    split = make_split("gemma4", inside, marker_ids(tok, GEMMA4))
    steps = []
    for i, token in enumerate(ids):
        reasoning, content, reason = split_text(stream, split, token, "length" if i == len(ids) - 1 else None)
        steps.append((reasoning, content))
        if reason is not None:
            break
    return steps, split.tokens


def joined(steps: list[tuple[str, str]]) -> tuple[str, str]:
    return "".join(r for r, _ in steps), "".join(c for _, c in steps)


def test_the_markers_are_the_demo_tokenizers_special_tokens(tok: Any) -> None:
    start, end = marker_ids(tok, GEMMA4)
    assert tok.convert_ids_to_tokens([start, end]) == ["<|channel>", "<channel|>"]
    assert tok.decode([start, end], skip_special_tokens=True) == ""  # why the split cannot work on text


def test_reasoning_between_the_markers_content_after_streamed_pieces_agree(tok: Any) -> None:
    start, end = marker_ids(tok, GEMMA4)
    thought = ids_of(tok, "thought\nLet me count: two and two.\n")
    ids = [start, *thought, end, *ids_of(tok, "It is four.")]
    steps, tokens = run(tok, ids)
    assert joined(steps) == ("Let me count: two and two.\n", "It is four.")
    # the whole sequence decoded part by part: what a non-streaming reader of the same ids would split it into
    assert joined(steps)[1] == tok.decode(ids[ids.index(end) + 1:], skip_special_tokens=True)
    assert tokens == 1 + len(thought) + 1
    # the channel name comes in several tokens ("th", "ou", ...): never any of it in either part
    assert all("th" not in r for r, _ in steps[:3]) and not any(c for _, c in steps[: ids.index(end)])


def test_stop_string_hold_back_and_an_incomplete_character_stay_on_their_side_of_a_marker(tok: Any) -> None:
    start, end = marker_ids(tok, GEMMA4)
    ids = [start, *ids_of(tok, "thought\nsum is 4"), end, *ids_of(tok, "It is four.")]
    # "4It" could begin a stop string: "4" is held past the end marker, then let out with "It" in one piece
    steps, _ = run(tok, ids, stops=("4It is five",))
    assert joined(steps) == ("sum is 4", "It is four.")
    assert any(r and c for r, c in steps)  # that piece was cut at the boundary
    # a character's first byte right before a marker: the cut lets it out (as U+FFFD) as reasoning, not content
    ids = [start, *ids_of(tok, "thought\nok"), tok.convert_tokens_to_ids("<0xC3>"), end, *ids_of(tok, "fine")]
    assert joined(run(tok, ids)[0]) == ("ok\ufffd", "fine")


def test_without_markers_everything_is_content(tok: Any) -> None:
    ids = ids_of(tok, "thought\nThe answer is four.")
    steps, tokens = run(tok, ids)
    assert joined(steps) == ("", "thought\nThe answer is four.") and tokens == 0
    # an end marker with no block open is content (dropped, as any special token), not reasoning
    _, end = marker_ids(tok, GEMMA4)
    steps, tokens = run(tok, [*ids_of(tok, "Four"), end, *ids_of(tok, " it is.")])
    assert joined(steps) == ("", "Four it is.") and tokens == 0


def test_a_prompt_that_opened_the_channel_starts_inside(tok: Any) -> None:
    _, end = marker_ids(tok, GEMMA4)
    inner = ids_of(tok, "Let me count.")
    steps, tokens = run(tok, [*inner, end, *ids_of(tok, "\nFour.")], inside=True)
    assert joined(steps) == ("Let me count.", "Four.") and tokens == len(inner) + 1


def test_an_answer_cut_inside_the_reasoning_is_all_reasoning(tok: Any) -> None:
    start, _ = marker_ids(tok, GEMMA4)
    steps, tokens = run(tok, [start, *ids_of(tok, "thought\nStill thinking about")])
    assert joined(steps) == ("Still thinking about", "")
    assert tokens == 1 + len(ids_of(tok, "thought\nStill thinking about"))
    # cut while the name was being written: the name alone is dropped, a name it was not stays
    assert joined(run(tok, [start, *ids_of(tok, "thought")])[0]) == ("", "")
    assert joined(run(tok, [start, *ids_of(tok, "though")])[0]) == ("though", "")


def test_a_tokenizer_without_the_marker_tokens_is_refused_in_one_line(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0, "<|channel>": 1}, "<unk>")),
                                    unk_token="<unk>")
    plain.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as refused:
        check_markers("gemma4", str(tmp_path))
    message = str(refused.value)
    assert "\n" not in message and "--reasoning-parser gemma4" in message
    assert "no special token <|channel> or <channel|>" in message  # in the vocabulary, but not special: no use
    check_markers("qwen3", str(tmp_path))  # text markers: nothing to check
