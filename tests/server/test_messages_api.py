"""Anthropic's Messages API (``POST /v1/messages``) through the real server and the official anthropic client, on
the demo checkpoint: greedy text equals transformers' on the chat template's rendering of the same conversation,
whole and streamed; images and tool calls take the chat path (a tool_use block with its input object, its
tool_result continuing the conversation as chat would); usage counts cached tokens as Anthropic does; what is not
served is a 400 naming the field."""

from __future__ import annotations

import base64
import json
from typing import Any

import anthropic
import pytest

from tests.reference import HFReference
from tests.server.live import LiveServer, data_url, png_bytes

MAX_NEW = 10
GREEDY: Any = {"temperature": 0}  # (the anthropic client takes temperature only as extra_body)
TOOLS: Any = [{"name": "total", "description": "sum",
               "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}]


def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0)


def create(server: LiveServer, **fields: Any) -> Any:
    args: dict[str, Any] = {"model": "demo", "max_tokens": MAX_NEW, "extra_body": GREEDY, **fields}
    return client(server).messages.create(**args)


def test_text_equals_transformers_greedy_whole_and_streamed(live: LiveServer, ref: HFReference) -> None:
    messages: Any = [{"role": "user", "content": "Read the invoice total."}]
    ids = ref.prompt_ids([{"role": "system", "content": "Be brief."}, *messages])
    expected, _ = ref.greedy(ids, MAX_NEW)
    whole = create(live, system="Be brief.", messages=messages)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == ref.text(expected)
    usage = whole.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(ids) and usage.output_tokens == len(expected)
    assert whole.stop_reason == ("max_tokens" if len(expected) == MAX_NEW else "end_turn")
    with client(live).messages.stream(model="demo", max_tokens=MAX_NEW, system="Be brief.", messages=messages,
                                      extra_body=GREEDY) as stream:  # fmt: skip
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == len(expected)
    # The same prompt again: its full blocks come from the prefix cache, reported as Anthropic reports cache reads.
    again = create(live, system="Be brief.", messages=messages)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(ids)


def test_a_final_assistant_turn_is_continued(live: LiveServer, ref: HFReference) -> None:
    """Anthropic's prefill: the answer continues the last assistant text, as transformers' template renders a
    continued final message (no end of turn, no new assistant header), and holds only the new text."""
    messages: Any = [{"role": "user", "content": "Read the invoice total."},
                     {"role": "assistant", "content": "The total is"}]  # fmt: skip
    out = ref.processor.apply_chat_template(messages, tokenize=True, continue_final_message=True, return_dict=True)
    ids = [int(t) for t in (out["input_ids"][0] if isinstance(out["input_ids"][0], list) else out["input_ids"])]
    expected, _ = ref.greedy(ids, MAX_NEW)
    message = create(live, messages=messages)
    assert message.content[0].text == ref.text(expected)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(ids)
    assert len(ids) < len(ref.prompt_ids(messages))  # a new turn would have closed this one and opened another


def test_count_tokens_counts_the_prompt_a_message_would_have(live: LiveServer, ref: HFReference) -> None:
    """Anthropic's POST /v1/messages/count_tokens (the SDK's messages.count_tokens; no max_tokens): the prompt's
    tokens as the Message's usage counts them, images' tokens included, and the same refusals."""
    messages: Any = [{"role": "user", "content": "Read the invoice total."}]
    counted = client(live).messages.count_tokens(model="demo", system="Be brief.", messages=messages)
    assert counted.input_tokens == len(ref.prompt_ids([{"role": "system", "content": "Be brief."}, *messages]))
    raw = png_bytes(96, 64, seed=44)
    blocks: Any = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                "data": base64.b64encode(raw).decode()}},
                   {"type": "text", "text": "What is on the page?"}]  # fmt: skip
    with_image = client(live).messages.count_tokens(model="demo", messages=[{"role": "user", "content": blocks}])
    message = create(live, messages=[{"role": "user", "content": blocks}])
    assert with_image.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError) as err:
        client(live).messages.count_tokens(model="demo", messages=[{"role": "user", "content": [
            {"type": "document", "source": {}}]}])  # fmt: skip
    assert isinstance(err.value.body, dict) and err.value.body["error"]["param"] == "messages[0].content[0].type"


def test_an_image_block_takes_the_chat_path(live: LiveServer) -> None:
    raw = png_bytes(96, 64, seed=43)
    blocks: Any = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                "data": base64.b64encode(raw).decode()}},
                   {"type": "text", "text": "What is on the page?"}]  # fmt: skip
    message = create(live, messages=[{"role": "user", "content": blocks}])
    chat = live.client().chat.completions.create(
        model="demo", max_tokens=MAX_NEW, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(raw)}},
                                               {"type": "text", "text": "What is on the page?"}]}])  # fmt: skip
    assert chat.usage is not None and message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_a_forced_tool_use_and_its_result_continue_as_chat(live: LiveServer) -> None:
    called = create(live, messages=[{"role": "user", "content": "Sum it."}], tools=TOOLS,
                    tool_choice={"type": "tool", "name": "total"}, max_tokens=60)  # fmt: skip
    [use] = called.content
    assert use.type == "tool_use" and use.name == "total" and set(use.input) == {"x"}
    assert called.stop_reason == "tool_use"
    with client(live).messages.stream(model="demo", max_tokens=60, messages=[{"role": "user", "content": "Sum it."}],
                                      tools=TOOLS, tool_choice={"type": "tool", "name": "total"},
                                      extra_body=GREEDY) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "input_json" in kinds
    assert [b.input for b in final.content] == [use.input]
    turn: Any = [{"role": "user", "content": "Sum it."},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": "total", "input": use.input}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}]  # fmt: skip
    after = create(live, messages=turn, tools=TOOLS)
    chat = live.client().chat.completions.create(
        model="demo", max_tokens=MAX_NEW, temperature=0,
        tools=[{"type": "function", "function": {"name": "total", "description": "sum",
                                                 "parameters": TOOLS[0]["input_schema"]}}],
        messages=[{"role": "user", "content": "Sum it."},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function",
                   "function": {"name": "total", "arguments": json.dumps(use.input)}}]},
                  {"role": "tool", "tool_call_id": use.id, "content": "42"}])  # fmt: skip
    assert chat.usage is not None
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert "".join(b.text for b in after.content if b.type == "text") == (chat.choices[0].message.content or "")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
         "messages[0].content[0].source"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "messages[0].content[0].source"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(live: LiveServer, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        create(live, **{"messages": [{"role": "user", "content": "Hello"}], **fields})
    assert isinstance(err.value.body, dict) and err.value.body["error"]["param"] == param, err.value.body
