"""Gemma 4's tool calls: whatever way the text is cut into deltas, the content and the calls come out the same, with
Gemma's values (quoted strings, bare words, numbers, nested objects and arrays) rebuilt as JSON arguments; and the
detokenizer keeps the format's special tokens in the text while it drops the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.workers.common.test_tools import cut, run as tools_run
from workers.common.detokenizer import IncrementalDetokenizer
from workers.common.tool_gemma import keep_ids, parse_arguments, uses_gemma_calls

Q = '<|"|>'
ANSWER = (
    f"Let me check.<|tool_call>call:get_weather{{city:{Q}New York, NY{Q},days:3,metric:true,at:-12.5e1,"
    f'where:{{lat:40.7,tags:[{Q}a{Q},"b",null]}},note:{Q}{{not: a brace}}{Q}}}<tool_call|>'
    "<|tool_call>call:get_time{}<tool_call|>"
)
WEATHER = {"city": "New York, NY", "days": 3, "metric": True, "at": -125.0,
           "where": {"lat": 40.7, "tags": ["a", "b", None]}, "note": "{not: a brace}"}  # fmt: skip


def run(pieces: list[str], reason: str = "stop") -> tuple[str, dict[int, dict[str, str]], str | None]:
    return tools_run(pieces, reason, "gemma4")


@pytest.mark.parametrize("seed", range(30))
def test_any_cut_gives_the_whole_answers_calls(seed: int) -> None:
    content, calls, reason = run(cut(ANSWER, seed))
    assert content == "Let me check." and reason == "tool_calls"
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == WEATHER and calls[1]["arguments"] == "{}"
    assert all(c["id"].startswith("call_") for c in calls.values()) and calls[0]["id"] != calls[1]["id"]


def test_blocks_that_are_not_calls_stay_content_and_a_broken_announced_call_keeps_empty_arguments() -> None:
    broken = "<|tool_call>not a call<tool_call|> after"
    assert run(cut(broken, 2)) == (broken, {}, "stop")
    content, calls, reason = run(["<|tool_call>call:f{a:", "<tool_call|>"])
    assert content == "" and calls[0]["name"] == "f" and calls[0]["arguments"] == "{}" and reason == "tool_calls"
    with pytest.raises(ValueError):
        parse_arguments("{a:1} trailing")
    assert uses_gemma_calls("... <|tool_call>call:' + name + '{ ... <tool_call|> ...") and not uses_gemma_calls("<tool_call>")


def test_the_detokenizer_keeps_the_format_s_tokens_and_drops_other_special_ones(gemma4_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gemma4_model_dir)
    keep = keep_ids(tokenizer)
    assert len(keep) == 3
    text = f"Hi<|tool_call>call:f{{a:{Q}x{Q}}}<tool_call|>"
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.convert_tokens_to_ids("<turn|>")]
    for kept, want in ((keep, text), (frozenset(), 'Hicall:f{a:x}')):
        detok = IncrementalDetokenizer(tokenizer, keep=kept)
        assert "".join(detok.push([t]) for t in ids) + detok.flush() == want
