"""OpenAI's Responses API (``POST /v1/responses``) through the real server and the official openai client, on the
demo checkpoint: greedy text equals transformers' on the chat template's rendering of the same conversation,
streamed events carry the same text and end with the usage, images and tool calls take the chat path, a tool's
output continues the conversation as chat would, and what is not served is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.reference import HFReference
from tests.server.live import LiveServer, data_url, png_bytes

MAX_NEW = 10
TOOLS: Any = [{"type": "function", "name": "total", "description": "Add up the invoice.",
               "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}]


def respond(server: LiveServer, **fields: Any) -> Any:
    args: dict[str, Any] = {"model": "demo", "max_output_tokens": MAX_NEW, "temperature": 0, **fields}
    return server.client().responses.create(**args)


def test_text_equals_transformers_greedy_whole_and_streamed(live: LiveServer, ref: HFReference) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read the invoice total."}]
    ids = ref.prompt_ids(messages)
    expected, _ = ref.greedy(ids, MAX_NEW)
    whole = respond(live, instructions="Be brief.", input="Read the invoice total.")
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == "demo"
    assert whole.output_text == ref.text(expected)
    assert whole.usage.input_tokens == len(ids) and whole.usage.output_tokens == len(expected)
    assert whole.status == ("incomplete" if len(expected) == MAX_NEW else "completed")
    assert whole.instructions == "Be brief." and whole.store is False
    # The same conversation as items, streamed: the deltas make the same text, response.completed the same Response.
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read the invoice total."}]}]
    seen: list[Any] = list(respond(live, instructions="Be brief.", input=items, stream=True))
    kinds = [e.type for e in seen]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    final = seen[-1].response
    assert text == final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    # Cut by max_output_tokens: incomplete, and says why.
    cut = respond(live, input="Read the invoice total.", max_output_tokens=2, extra_body={"ignore_eos": True})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_images_and_logprobs_take_the_chat_path(live: LiveServer) -> None:
    image = data_url(png_bytes(96, 64, seed=41))
    parts: Any = [{"type": "input_image", "image_url": image}, {"type": "input_text", "text": "What is on the page?"}]
    response = respond(live, input=[{"role": "user", "content": parts}], top_logprobs=2)
    chat = live.client().chat.completions.create(
        model="demo", max_tokens=MAX_NEW, temperature=0, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                               {"type": "text", "text": "What is on the page?"}]}])  # fmt: skip
    assert chat.usage is not None and chat.choices[0].logprobs is not None
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    logprobs = response.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in logprobs] == [(c.token, c.logprob) for c in chat.choices[0].logprobs.content]
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)


def test_a_forced_tool_call_and_its_output_continue_as_chat(live: LiveServer) -> None:
    called = respond(live, input="Sum it.", tools=TOOLS, tool_choice="required", max_output_tokens=60)
    [call] = called.output
    assert call.type == "function_call" and call.name == "total" and call.call_id and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"x"}
    streamed: list[Any] = list(respond(live, input="Sum it.", tools=TOOLS, stream=True, max_output_tokens=60,
                                       tool_choice={"type": "function", "name": "total"}))  # fmt: skip
    added = [e.item for e in streamed if e.type == "response.output_item.added"]
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert [i.type for i in added] == ["function_call"] and arguments == call.arguments
    # The call and its output sent back as items: the answer chat gives the same conversation.
    turn: Any = [{"role": "user", "content": "Sum it."},
                 {"type": "function_call", "call_id": call.call_id, "name": "total", "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "42"}]  # fmt: skip
    after = respond(live, input=turn, tools=TOOLS)
    chat = live.client().chat.completions.create(
        model="demo", max_tokens=MAX_NEW, temperature=0, tools=[{"type": "function", "function": {
            k: TOOLS[0][k] for k in ("name", "description", "parameters")}}],
        messages=[{"role": "user", "content": "Sum it."},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                   "function": {"name": "total", "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "42"}])  # fmt: skip
    assert chat.usage is not None and after.usage.input_tokens == chat.usage.prompt_tokens
    assert after.output_text == (chat.choices[0].message.content or "")


class Check(BaseModel):
    paid: bool


def test_text_format_json_schema_through_the_sdks_parse(live: LiveServer) -> None:
    """``responses.parse`` sends a strict json_schema as text.format; the grammar holds the answer to it."""
    parsed = live.client().responses.parse(model="demo", input="Is the invoice paid?", text_format=Check,
                                           max_output_tokens=40, temperature=0)  # fmt: skip
    assert isinstance(parsed.output_parsed, Check) and parsed.status == "completed"
    assert parsed.text is not None and parsed.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_0"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
         "input[0].content[0].image_url"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"extra_body": {"n": 2}}, "n"),
        ({"extra_body": {"messages": [{"role": "user", "content": "x"}]}}, "messages"),
        ({"model": "other"}, "model"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(live: LiveServer, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        respond(live, **{"input": "Hello", **fields})
    assert err.value.status_code in (400, 404)
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == param, err.value.body
