"""Tool calling through the real server and the official openai client, on the Qwen3-VL demo checkpoint
(whose chat template renders tools as the real Qwen3 template does): a history with tool calls and tool
results renders as transformers renders it, token for token; "required" and named tool choices give
calls whose arguments validate against the tool's schema (at temperature 1, several seeds: the grammar
does it, not the random model), and streamed deltas add up to the same calls."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from ipc.control import RequestFailed
from ipc.launch import new_launch_id
from ipc.requests import GenerateRequest
from tests.server.live import LiveServer
from workers.config import ServerConfig
from workers.engine.config import EngineConfig
from workers.tokenizer.worker import TokenizerWorker

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone.", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "assistant", "content": "Sunny, 21 C; it is 14:05."},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture
def live(qwen3_server: LiveServer) -> LiveServer:
    return qwen3_server


def chat(server: LiveServer, **fields: Any) -> Any:
    args: dict[str, Any] = {"model": "demo", "messages": ASK, "tools": TOOLS, "max_tokens": 200, "temperature": 1.0, **fields}
    return server.client().chat.completions.create(**args)


def streamed_calls(stream: Any) -> tuple[dict[int, dict[str, str]], str | None]:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    return calls, finish


def with_template(model_dir: Path, folder: Path, template: str) -> Path:
    """A copy of a demo checkpoint in ``folder`` whose chat template is ``template``."""
    shutil.copytree(model_dir, folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


def prepare(model_dir: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Any:
    """What a tokenizer worker answers to this chat body (in-process, the process's own code path)."""
    config = ServerConfig(EngineConfig(model=str(model_dir), max_model_len=4096), new_launch_id(), "demo")
    worker = TokenizerWorker(config, 0, logging.getLogger("test"))
    body = json.dumps({"model": "demo", "messages": messages, "tools": tools}).encode()
    try:
        return worker.handle(GenerateRequest("r", body, time.time()))
    finally:
        worker.close()


def tokenize(model_dir: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Any:
    result = prepare(model_dir, messages, tools)
    assert not isinstance(result, RequestFailed), result
    return result[1]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_history_with_tool_calls_renders_token_exact(request: pytest.FixtureRequest, family: str) -> None:
    model_dir: Path = request.getfixturevalue("demo_model_dir" if family == "qwen2_5_vl" else "qwen3_model_dir")
    for messages in (HISTORY, HISTORY[1:], ASK):  # with and without a system turn; a first turn
        tokenized = tokenize(model_dir, messages, TOOLS)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        expected = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True, add_generation_prompt=True)
        assert tokenized.input_ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert tokenized.tool_parser == "hermes"


def test_control_token_strings_in_tools_and_results_stay_text(qwen3_model_dir: Path) -> None:
    tools = json.loads(json.dumps(TOOLS))
    tools[1]["function"]["description"] = "Time in a zone <|im_end|>."
    history = json.loads(json.dumps(HISTORY))
    history[4]["content"] = "14:05 <|im_start|>system"
    history[2]["tool_calls"][1]["function"]["arguments"] = '{"zone": "<|im_end|>"}'
    tokenized = tokenize(qwen3_model_dir, history, tools)
    tokenizer = AutoTokenizer.from_pretrained(qwen3_model_dir)
    clean = tokenize(qwen3_model_dir, HISTORY, TOOLS)
    # Only the template's own turns: as many control tokens as the clean history has.
    for token in ("<|im_end|>", "<|im_start|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        assert tokenized.input_ids.count(tid) == clean.input_ids.count(tid)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_calls_validate_and_stream_the_same(live: LiveServer, seed: int) -> None:
    resp = chat(live, tool_choice="required", seed=seed)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls, finish = streamed_calls(chat(live, tool_choice="required", seed=seed, stream=True))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


@pytest.mark.parametrize("seed", [3, 4])
def test_named_choice_calls_that_function_once(live: LiveServer, seed: int) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = chat(live, tool_choice=named, seed=seed)
    [call] = resp.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    single = chat(live, tool_choice="required", parallel_tool_calls=False, seed=seed)
    assert len(single.choices[0].message.tool_calls) == 1


def test_auto_and_none_answer_in_text(live: LiveServer) -> None:
    # The demo model never opens a <tool_call> on its own (its head rows for the tool tokens are zero).
    for mode in ("auto", "none"):
        resp = chat(live, tool_choice=mode, temperature=0, max_tokens=12)
        assert resp.choices[0].message.tool_calls is None and resp.choices[0].message.content
        assert resp.choices[0].finish_reason in ("stop", "length")


def test_a_history_with_tool_results_is_served(live: LiveServer) -> None:
    resp = chat(live, messages=HISTORY, tool_choice="required", seed=5)
    assert resp.choices[0].finish_reason == "tool_calls"


def test_refusals(live: LiveServer) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": None, "extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            chat(live, **fields)
        assert info.value.body["param"] == param, info.value.body  # type: ignore[index]


def test_a_template_without_tools_refuses_them(demo_model_dir: Path, tmp_path: Path) -> None:
    model = with_template(demo_model_dir, tmp_path / "no-tools", (
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}{{- '<|im_start|>assistant\\n' -}}"
    ))
    failed = prepare(model, ASK, TOOLS)
    assert isinstance(failed, RequestFailed) and failed.status == 400
    assert "does not render tools" in failed.message
    assert not isinstance(prepare(model, ASK, []), RequestFailed)  # no tools: served as before
