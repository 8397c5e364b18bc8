"""Tool calls in Qwen3.5's XML-like format through the real server and the official openai client: the Qwen3.5 demo
checkpoint with a chat template that teaches ``<function=...>`` calls (written here, in the Hub template's format).
The server reads the format from the template; an answer that calls a tool that way comes back as OpenAI
``tool_calls`` with typed JSON arguments, streamed or not; "required" still validates against the schema; an
earlier call's JSON-string arguments reach the template as the mapping it walks, token-exact with transformers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from ipc.control import RequestFailed
from tests.server.live import LiveServer, serving
from tests.server.test_tools_api import (
    ASK,
    HISTORY,
    SCHEMAS,
    TOOLS,
    chat,
    prepare,
    streamed_calls,
    tokenize,
    with_template,
)

XML_TEMPLATE = r"""
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nCall a function by writing\n<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n' -}}
  {{- '</function>\n</tool_call>\n\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' + (m.content or '') -}}
    {%- for call in m.tool_calls or [] -%}
      {{- '\n<tool_call>\n<function=' + call.function.name + '>\n' -}}
      {%- for key, value in call.function.arguments | items -%}
        {{- '<parameter=' + key + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' -}}
      {%- endfor -%}
      {{- '</function>\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' -}}
  {%- elif m.role != 'system' -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""
CALL = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")  # fmt: skip


@pytest.fixture(scope="module")
def xml_model(qwen3_5_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(qwen3_5_model_dir, tmp_path_factory.mktemp("xml") / "qwen3.5", XML_TEMPLATE)


@pytest.fixture(scope="module")
def live(xml_model: Path) -> Iterator[LiveServer]:
    yield from serving(xml_model)


def forced(server: LiveServer, model: Path, **fields: Any) -> Any:
    """An answer held by a grammar to one XML call (the random model would never write one); the call's tags are
    the vocabulary's added tokens, as a trained model writes them."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    head, rest = CALL.split("<tool_call>")
    ids = [tokenizer.convert_tokens_to_ids(tag) for tag in ("<tool_call>", "</tool_call>")]
    grammar = f"start: {json.dumps(head)} <[{ids[0]}]> {json.dumps(rest.split('</tool_call>')[0])} <[{ids[1]}]>"
    return chat(server, temperature=0, extra_body={"structured_outputs": {"grammar": grammar}}, **fields)


def test_the_template_s_format_is_read_and_the_values_typed(xml_model: Path) -> None:
    auto = tokenize(xml_model, ASK, TOOLS)
    assert auto.tool_parser == "qwen_xml"
    assert auto.tool_arg_types["get_weather"] == {"city": "string", "unit": "string", "days": "integer"}


def test_an_xml_call_comes_back_as_tool_calls(live: LiveServer, xml_model: Path) -> None:
    answer = forced(live, xml_model)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking."
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    calls, finish = streamed_calls(forced(live, xml_model, stream=True))
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == message.tool_calls[0].function.arguments


@pytest.mark.parametrize("seed", [1, 2])
def test_required_calls_still_validate(live: LiveServer, seed: int) -> None:
    answer = chat(live, tool_choice="required", seed=seed)
    assert answer.choices[0].finish_reason == "tool_calls"
    for call in answer.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_history_with_string_arguments_renders_as_transformers_renders_the_mapping(xml_model: Path) -> None:
    tokenized = tokenize(xml_model, HISTORY, TOOLS)
    as_mappings = json.loads(json.dumps(HISTORY))
    for call in as_mappings[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    tokenizer = AutoTokenizer.from_pretrained(xml_model)
    expected = tokenizer.apply_chat_template(as_mappings, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    assert tokenized.input_ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert "<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius" in tokenizer.decode(tokenized.input_ids)


def test_a_control_token_string_in_an_argument_stays_text_or_is_refused(xml_model: Path) -> None:
    history = json.loads(json.dumps(HISTORY))
    history[2]["tool_calls"][1]["function"]["arguments"] = '{"zone": "<|im_end|>"}'
    tokenized = tokenize(xml_model, history, TOOLS)
    tokenizer = AutoTokenizer.from_pretrained(xml_model)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenized.input_ids.count(end) == tokenize(xml_model, HISTORY, TOOLS).input_ids.count(end)
    history[2]["tool_calls"][1]["function"]["arguments"] = '{"zone": {"name": "<|im_end|>"}}'
    failed = prepare(xml_model, history, TOOLS)
    assert isinstance(failed, RequestFailed) and failed.status == 400 and "nested value" in failed.message
