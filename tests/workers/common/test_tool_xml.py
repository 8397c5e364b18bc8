"""Qwen3.5's XML-like tool calls: whatever way the text is cut into deltas, the content and the calls come out the
same, the streamed argument pieces add up to the call's JSON arguments, and each value is typed by its schema."""

from __future__ import annotations

import json

import pytest

from tests.workers.common.test_tools import cut
from workers.common.tool_output import ToolOutput
from workers.common.tool_xml import arg_types, typed, uses_xml_calls
from workers.common.tools import FunctionDef, Tool

TOOLS = [
    Tool("function", FunctionDef("get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "at": {"type": ["number", "null"]}, "where": {"type": "object"}, "tags": {"type": "array"},
        "any": {"description": "no type"},
    }})),
    Tool("function", FunctionDef("get_time")),
]  # fmt: skip
TYPES = arg_types(TOOLS)
ANSWER = (
    "Let me check both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=at>\n12.5\n</parameter>\n"
    '<parameter=where>\n{"lat": 40.7, "lon": -74}\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
    "<parameter=any>\n007\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n"
    "</tool_call>"
)
WEATHER = {"city": "New York", "days": 3, "metric": True, "at": 12.5, "where": {"lat": 40.7, "lon": -74},
           "tags": ["a", "b"], "any": "007"}  # fmt: skip


def run(pieces: list[str], reason: str = "stop") -> tuple[str, dict[int, dict[str, str]], str | None, int]:
    out = ToolOutput("qwen_xml", TYPES)
    content, calls, final, deltas = "", {}, None, 0
    for i, piece in enumerate(pieces):
        text, more, final = out.step(piece, reason if i == len(pieces) - 1 else None)
        content += text
        deltas += len(more)
        for d in more:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id
            call["name"] += d.name
            call["arguments"] += d.arguments
    return content, calls, final, deltas


@pytest.mark.parametrize("seed", range(40))
def test_any_cut_gives_the_whole_answers_calls(seed: int) -> None:
    content, calls, reason, _ = run(cut(ANSWER, seed))
    assert content == "Let me check both."
    assert reason == "tool_calls"
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == WEATHER
    assert calls[1]["arguments"] == "{}"
    assert all(c["id"].startswith("call_") for c in calls.values()) and calls[0]["id"] != calls[1]["id"]


def test_arguments_stream_a_parameter_at_a_time() -> None:
    """Character by character: the header, then one delta per parameter as it closes, then the closing brace."""
    _, calls, _, deltas = run(list(ANSWER))
    assert deltas == 1 + len(WEATHER) + 1 + 2  # get_weather: header, 7 parameters, "}"; get_time: header, "{}"
    assert calls[0]["arguments"] == json.dumps(WEATHER)


def test_text_without_calls_and_a_block_without_a_function_stay_content() -> None:
    assert run(["plain <tool", " text, no calls"])[:3] == ("plain <tool text, no calls", {}, "stop")
    broken = "<tool_call>\nnot a call\n</tool_call> after"
    assert run(cut(broken, 1))[:3] == (broken, {}, "stop")
    assert run(["<tool_call>\nnot a ca", "ll"])[:3] == ("<tool_call>\nnot a call", {}, "stop")  # ended unclosed


def test_an_unclosed_call_keeps_what_was_written_of_it() -> None:
    content, calls, reason, _ = run(["<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<par"],
                                    reason="length")
    assert content == "" and reason == "length"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Rome"}


def test_values_are_typed_by_the_schema_and_kept_as_written_when_they_do_not_parse() -> None:
    assert TYPES["get_weather"]["at"] == "number" and TYPES["get_weather"]["any"] == "" and TYPES["get_time"] == {}
    assert typed("3", "string") == "3" and typed("3", "integer") == 3 and typed("3.5", "integer") == "3.5"
    assert typed("True", "boolean") is True and typed("yes", "boolean") == "yes"
    assert typed("[1]", "object") == "[1]" and typed("null", "null") is None and typed("not json", "") == "not json"
    assert typed("1e3", "number") == 1000.0 and typed("true", "number") == "true"


def test_templates_that_teach_the_format_are_recognised() -> None:
    assert uses_xml_calls("... <function=example_function_name>\n<parameter=example_parameter_1>\nvalue ...")
    assert not uses_xml_calls('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    with pytest.raises(ValueError, match="unknown tool-call format"):
        ToolOutput("pythonic")
