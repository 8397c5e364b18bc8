"""The <tool_call> parser: whatever way the text is cut into deltas, the content and the calls come out the
same, and the streamed argument pieces add up to the whole call's arguments."""

from __future__ import annotations

import json
import random

import pytest

from ipc.outputs import ToolCallDelta
from ipc.prompts import StructuredSpec
from workers.common.tool_output import ToolOutput
from workers.common.tools import FunctionDef, NamedFunction, NamedToolChoice, Tool, tool_grammar

ANSWER = (
    "Let me check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "units": {"temp": "C"}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def run(pieces: list[str], reason: str = "stop", fmt: str = "hermes") -> tuple[str, dict[int, dict[str, str]], str | None]:
    """The pieces through a ``fmt`` parser: content, calls (deltas merged per index), finish reason."""
    out = ToolOutput(fmt)
    content, calls, final = "", {}, None
    deltas: list[ToolCallDelta] = []
    for i, piece in enumerate(pieces):
        text, more, final = out.step(piece, reason if i == len(pieces) - 1 else None)
        content += text
        deltas += more
    for d in deltas:
        call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        call["id"] += d.id
        call["name"] += d.name
        call["arguments"] += d.arguments
    return content, calls, final


def cut(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    points = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, 30)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@pytest.mark.parametrize("seed", range(40))
def test_any_cut_gives_the_whole_answers_calls(seed: int) -> None:
    content, calls, reason = run(cut(ANSWER, seed))
    assert content == "Let me check both."
    assert reason == "tool_calls"
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert calls[0]["arguments"] == '{"city": "Paris", "units": {"temp": "C"}}'
    assert calls[1]["arguments"] == "{}"
    assert all(c["id"].startswith("call_") for c in calls.values()) and calls[0]["id"] != calls[1]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "units": {"temp": "C"}}


def test_text_without_calls_and_a_broken_block_stay_content() -> None:
    assert run(["plain <tool", " text, no calls"]) == ("plain <tool text, no calls", {}, "stop")
    broken = "<tool_call>\nnot json\n</tool_call> after"
    assert run(cut(broken, 1)) == (broken, {}, "stop")


def test_length_cut_keeps_its_reason() -> None:
    content, calls, reason = run(["<tool_call>\n", '{"name": "f", "argu'], reason="length")
    assert reason == "length" and calls[0]["name"] == "f"


def test_grammar_for_required_and_named_choices() -> None:
    tools = [
        Tool("function", FunctionDef("a", parameters={"type": "object", "properties": {"x": {"type": "integer"}}})),
        Tool("function", FunctionDef("b")),
    ]
    assert tool_grammar(tools, "auto", True) is None and tool_grammar(tools, "none", True) is None
    required = tool_grammar(tools, "required", True)
    assert isinstance(required, StructuredSpec) and required.kind == "lark"
    assert "fn0 | fn1" in required.value and '("\\n" call)*' in required.value
    named = tool_grammar(tools, NamedToolChoice("function", NamedFunction("b")), True)
    assert named is not None and "fn1" not in named.value and '"const": "b"' in named.value
    assert "call)*" not in named.value  # a named choice calls once


def test_forced_calls_of_tools_with_local_refs_compile() -> None:
    """pydantic writes a tool's parameters with "$defs" and "#/$defs/X" references; nested under the call's
    "arguments", each reference must follow the schema there, or the forced call's grammar does not compile."""
    params = {
        "$defs": {"Row": {"type": "object", "properties": {"n": {"type": "integer"}, "next": {"$ref": "#/$defs/Row"}}}},
        "type": "object",
        "properties": {"row": {"$ref": "#/$defs/Row"}, "whole": {"$ref": "#"}, "tag": {"const": {"$ref": "#/x"}}},
    }
    spec = tool_grammar([Tool("function", FunctionDef("f", parameters=params))], "required", False)
    assert spec is not None
    schema = json.loads(spec.value.split("fn0: %json ", 1)[1])["properties"]["arguments"]
    assert schema["properties"]["row"] == {"$ref": "#/properties/arguments/$defs/Row"}
    assert schema["$defs"]["Row"]["properties"]["next"] == {"$ref": "#/properties/arguments/$defs/Row"}
    assert schema["properties"]["whole"] == {"$ref": "#/properties/arguments"}
    assert schema["properties"]["tag"] == {"const": {"$ref": "#/x"}}  # data, not a reference
    import llguidance

    from workers.engine.runner.grammar import to_grammar

    assert llguidance.LLMatcher.validate_grammar(to_grammar(spec)) == ""
