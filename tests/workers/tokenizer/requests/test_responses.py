"""OpenAI's Responses body as the chat request it amounts to (workers/tokenizer/requests/responses.py): instructions
and input items become messages, the Responses names of max tokens, text format, tools, tool choice, reasoning and
logprobs land on their chat fields, what is not served is a 400 naming the field, and a refusal the chat path raises
later is named as the body names it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workers.common.errors import BadRequest
from workers.common.tools import NamedToolChoice
from workers.tokenizer.requests.chat import ImagePart, TextPart
from workers.tokenizer.requests.responses import parse_responses, responses_names

PNG = "data:image/png;base64,iVBORw0KGgo="
TOOL = {"type": "function", "name": "total", "description": "Add up.", "parameters": {"type": "object"}}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "input_text", "text": "Sum these."}, {"type": "input_image", "image_url": PNG, "detail": "low"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
    {"type": "reasoning", "id": "rs_1", "summary": []},
    {"type": "function_call", "call_id": "c1", "name": "total", "arguments": "{\"x\": 1}"},
    {"type": "function_call", "call_id": "c2", "name": "total", "arguments": "{\"x\": 2}"},
    {"type": "function_call_output", "call_id": "c1", "output": "1"},
    {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
]


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "demo", "input": "Hello", **fields}).encode()


def test_instructions_and_items_become_the_chat_messages() -> None:
    chat, fields = parse_responses(body(instructions="Be brief.", input=CONVERSATION, tools=[TOOL]))
    roles = [(m.role, m.tool_call_id) for m in chat.messages]
    assert roles == [("system", None), ("user", None), ("assistant", None), ("tool", "c1"), ("tool", "c2")]
    system, user, assistant = chat.messages[:3]
    assert system.content == "Be brief."
    assert isinstance(user.content, list) and user.content[0] == TextPart("Sum these.")
    image = user.content[1]
    assert isinstance(image, ImagePart) and image.url == PNG and image.image_url.detail == "low"  # type: ignore[union-attr]
    # The assistant's text and both calls are one turn; the reasoning item of that turn is left out.
    assert assistant.content == [TextPart("Let me add.")]
    assert [(c.id, c.function.name, c.function.arguments) for c in assistant.tool_calls or []] == [
        ("c1", "total", "{\"x\": 1}"), ("c2", "total", "{\"x\": 2}")]
    assert chat.messages[4].content == [TextPart("2")]
    assert chat.tools == [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}]
    assert json.loads(fields)["tools"] == [TOOL] and json.loads(fields)["instructions"] == "Be brief."
    one, _ = parse_responses(body())
    assert [(m.role, m.content) for m in one.messages] == [("user", "Hello")]


def test_responses_fields_land_on_their_chat_fields() -> None:
    schema = {"type": "object", "properties": {"total": {"type": "number"}}}
    chat, fields = parse_responses(body(
        max_output_tokens=9, temperature=0.5, top_p=0.9, top_logprobs=3, stream=True, parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "bill", "schema": schema, "strict": True}},
        tools=[TOOL], tool_choice={"type": "function", "name": "total"}, reasoning={"effort": "low"},
        top_k=5, seed=7, ignore_eos=True, store=True, metadata={"k": "v"}, user="u1"))  # fmt: skip
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.top_k, chat.seed) == (9, 0.5, 0.9, 5, 7)
    assert (chat.logprobs, chat.top_logprobs, chat.ignore_eos, chat.parallel_tool_calls) == (True, 3, True, False)
    assert chat.stream
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema is not None and chat.response_format.json_schema.schema == schema
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "total"
    assert chat.reasoning_effort == "low"
    stated = json.loads(fields)
    assert stated["store"] is False and stated["metadata"] == {"k": "v"} and stated["parallel_tool_calls"] is False
    assert stated["text"]["format"]["name"] == "bill" and stated["reasoning"] == {"effort": "low", "summary": None}
    logprobs, _ = parse_responses(body(include=["message.output_text.logprobs"]))
    assert (logprobs.logprobs, logprobs.top_logprobs) == (True, 0)
    plain, fields = parse_responses(body())
    assert plain.logprobs is None and plain.response_format is None and not plain.stream
    assert json.loads(fields)["text"] == {"format": {"type": "text"}} and json.loads(fields)["tool_choice"] == "auto"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
        ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input[0].content[0].file_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].image_url"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"temperature": -1}, "temperature"),
        ({"cache_salt": "tenant"}, "cache_salt"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ],
)
def test_what_is_not_served_is_named(fields: dict[str, Any], param: str) -> None:
    raw = body(**fields)
    with pytest.raises(BadRequest) as err:
        parse_responses(raw)
    assert err.value.status == 400
    assert responses_names(err.value, raw).param == param, err.value.message


def test_later_refusals_are_named_as_the_body_names_them() -> None:
    raw = body(instructions="Be brief.", input=CONVERSATION, tools=[TOOL])

    def name(param: str) -> str | None:
        return responses_names(BadRequest(f"Invalid '{param}'", param=param), raw).param

    assert name("messages[1].content[1].image_url") == "input[0].content[1].image_url"
    assert name("messages[2].tool_calls[1].function.arguments") == "input[4].arguments"
    assert name("messages[4].content") == "input[6].output" and name("messages[3].tool_call_id") == "input[5].call_id"
    assert name("messages[0].content") == "instructions" and name("messages") == "input"
    assert name("max_completion_tokens") == "max_output_tokens" and name("tools[0].function.parameters") == "tools[0].parameters"
    assert name("response_format.json_schema.schema") == "text.format.schema" and name("reasoning_effort") == "reasoning.effort"
    renamed = responses_names(BadRequest("Invalid 'max_completion_tokens': too many", param="max_completion_tokens"), raw)
    assert renamed.message == "Invalid 'max_output_tokens': too many"
