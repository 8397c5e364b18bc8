"""Gemma 4's tool calls through the real server and the official openai client: the Gemma 4 demo checkpoint with a
chat template that renders tools and writes calls in Gemma's syntax (written here; the demo's own template refuses
tools). The server reads the format from the template and keeps its special tokens in the text it parses: an answer
held to one Gemma call comes back as OpenAI ``tool_calls``, streamed or not; "required" still validates."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from tests.server.live import LiveServer, serving
from tests.server.test_tools_api import ASK, SCHEMAS, TOOLS, chat, streamed_calls, tokenize, with_template
from workers.common.tool_gemma import QUOTE

GEMMA_TOOLS_TEMPLATE = r"""
{{- '<bos>' -}}
{%- if tools -%}
  {{- '<|turn>system\n' -}}
  {%- for tool in tools -%}{{- '<|tool>' + (tool | tojson) + '<tool|>' -}}{%- endfor -%}
  {{- '<turn|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {{- '<|turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' + (m.content if m.content is string else '') -}}
  {%- for call in m.tool_calls or [] -%}
    {{- '<|tool_call>call:' + call.function.name + '{}<tool_call|>' -}}
  {%- endfor -%}
  {{- '<turn|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|turn>model\n' -}}{%- endif -%}
"""


@pytest.fixture(scope="module")
def gemma_model(gemma4_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(gemma4_model_dir, tmp_path_factory.mktemp("gemma-tools") / "gemma4", GEMMA_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def live(gemma_model: Path) -> Iterator[LiveServer]:
    yield from serving(gemma_model)


def forced(server: LiveServer, model: Path, **fields: Any) -> Any:
    """An answer held by a grammar to one Gemma call, its tags and quotes the vocabulary's special tokens."""
    tok = AutoTokenizer.from_pretrained(model)
    o, c, q = (f"<[{tok.convert_tokens_to_ids(t)}]>" for t in ("<|tool_call>", "<tool_call|>", '<|"|>'))
    grammar = f'start: "Checking." {o} "call:get_weather{{city:" {q} "Paris" {q} ",days:3}}" {c}'
    return chat(server, temperature=0, extra_body={"structured_outputs": {"grammar": grammar}}, **fields)


def test_the_template_s_format_is_read(gemma_model: Path) -> None:
    assert tokenize(gemma_model, ASK, TOOLS).tool_parser == "gemma4"


def test_a_gemma_call_comes_back_as_tool_calls(live: LiveServer, gemma_model: Path) -> None:
    answer = forced(live, gemma_model)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    calls, finish = streamed_calls(forced(live, gemma_model, stream=True))
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == message.tool_calls[0].function.arguments


def test_required_calls_still_validate(live: LiveServer) -> None:
    answer = chat(live, tool_choice="required", seed=3)
    assert answer.choices[0].finish_reason == "tool_calls"
    for call in answer.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_answers_without_tools_keep_dropping_special_tokens(live: LiveServer, gemma_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(gemma_model)
    q = f"<[{tok.convert_tokens_to_ids(QUOTE)}]>"
    answer = live.client().chat.completions.create(
        model="demo", messages=ASK, max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"grammar": f'start: "a" {q} "b"'}},
    )
    assert answer.choices[0].message.content == "ab"
