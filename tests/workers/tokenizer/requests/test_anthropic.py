"""Anthropic's Messages body as the chat request it amounts to (workers/tokenizer/requests/anthropic.py): system and
blocks become chat messages (tool results before the turn's other blocks, earlier thinking left out), the Messages
names of the sampling, tool and thinking fields land on their chat fields, and refusals are named as the body names
them, whether parsing or the chat path raises them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workers.common.errors import BadRequest
from workers.common.tools import NamedToolChoice
from workers.tokenizer.requests.anthropic import messages_names, parse_messages
from workers.tokenizer.requests.chat import ImagePart, TextPart

TOOL = {"name": "total", "description": "Add up.", "input_schema": {"type": "object"}}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "text", "text": "Sum these."}, IMAGE]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Two rows.", "signature": "s"},
                                      {"type": "text", "text": "Adding."},
                                      {"type": "tool_use", "id": "t1", "name": "total", "input": {"x": 1}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "1"}]},
                                 {"type": "text", "text": "And the tax?"}]},
]  # fmt: skip


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "demo", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}],
                       **fields}).encode()  # fmt: skip


def test_blocks_become_the_chat_messages() -> None:
    chat = parse_messages(body(system=[{"type": "text", "text": "Be brief."}], messages=TURNS, tools=[TOOL]))
    assert [(m.role, m.tool_call_id) for m in chat.messages] == [
        ("system", None), ("user", None), ("assistant", None), ("tool", "t1"), ("user", None)]
    user, assistant = chat.messages[1], chat.messages[2]
    assert isinstance(user.content, list) and isinstance(user.content[1], ImagePart)
    assert user.content[1].url == "data:image/png;base64,iVBORw0KGgo="
    assert assistant.content == [TextPart("Adding.")]  # the earlier turn's thinking is left out
    assert [(c.id, c.function.name, json.loads(str(c.function.arguments))) for c in assistant.tool_calls or []] == [
        ("t1", "total", {"x": 1})]
    assert chat.messages[3].content == [TextPart("1")] and chat.messages[4].content == [TextPart("And the tax?")]
    assert chat.tools == [{"type": "function", "function": {"name": "total", "description": "Add up.",
                                                            "parameters": {"type": "object"}}}]  # fmt: skip


def test_messages_fields_land_on_their_chat_fields() -> None:
    chat = parse_messages(body(max_tokens=9, temperature=0.5, top_p=0.9, top_k=4, stop_sequences=["END"], stream=True,
                               tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               metadata={"user_id": "u1"}, thinking={"type": "disabled"}))  # fmt: skip
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.top_k, chat.stop) == (9, 0.5, 0.9, 4, ["END"])
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False and chat.user == "u1"
    assert chat.stream and chat.chat_template_kwargs == {"enable_thinking": False}
    named = parse_messages(body(tools=[TOOL], tool_choice={"type": "tool", "name": "total"}))
    assert isinstance(named.tool_choice, NamedToolChoice) and named.tool_choice.function.name == "total"
    assert parse_messages(body(thinking={"type": "enabled"})).chat_template_kwargs == {"enable_thinking": True}
    budgeted = parse_messages(body(thinking={"type": "enabled", "budget_tokens": 2048}))
    assert budgeted.thinking_token_budget == 2048 and budgeted.chat_template_kwargs == {"enable_thinking": True}


def test_a_final_assistant_turn_is_a_prefill_the_answer_continues() -> None:
    turns = [{"role": "user", "content": "Total?"}, {"role": "assistant", "content": "The total is"}]
    chat = parse_messages(body(messages=turns))
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert chat.messages[-1].role == "assistant" and chat.messages[-1].content == "The total is"
    opened = parse_messages(body(messages=turns[:1]))  # a user turn last: the template opens the assistant's turn
    assert opened.add_generation_prompt and not opened.continue_final_message
    # A tool call cannot be continued: its result must follow in a user turn.
    raw = body(messages=[*turns[:1], TURNS[1]], tools=[TOOL])
    with pytest.raises(BadRequest) as err:
        parse_messages(raw)
    assert messages_names(err.value, raw).param == "messages[1]", err.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
         "messages[0].content[0].source"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]}, "messages[0].content[0].id"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": [1]}]}]},
         "messages[0].content[0].input"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"container": "c1"}, "container"),
        ({"temperature": 3}, "temperature"),
    ],
)
def test_what_is_not_served_is_named(fields: dict[str, Any], param: str) -> None:
    raw = body(**fields)
    with pytest.raises(BadRequest) as err:
        parse_messages(raw)
    assert err.value.status == 400 and messages_names(err.value, raw).param == param, err.value.message


def test_later_refusals_are_named_as_the_body_names_them() -> None:
    raw = body(system="Be brief.", messages=TURNS, tools=[TOOL])

    def name(param: str) -> str | None:
        return messages_names(BadRequest(f"Invalid '{param}'", param=param), raw).param

    assert name("messages[1].content[1].image_url") == "messages[0].content[1].source"
    assert name("messages[3].content[0].text") == "messages[2].content[0].content[0].text"
    assert name("messages[4].content[0].text") == "messages[2].content[1].text"
    assert name("messages[2].tool_calls[0].function.arguments") == "messages[1]"
    assert name("messages[0].content") == "system" and name("tools[0].function.parameters") == "tools[0].input_schema"
    assert name("max_completion_tokens") == "max_tokens" and name("stop") == "stop_sequences"
    assert name("thinking_token_budget") == "thinking.budget_tokens"


def test_max_tokens_is_required_except_to_count_tokens() -> None:
    raw = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "Hi"}]}).encode()
    with pytest.raises(BadRequest) as err:
        parse_messages(raw)
    assert (err.value.param, err.value.code) == ("max_tokens", "missing_required_parameter")
    assert parse_messages(raw, count=True).max_tokens == 1  # count_tokens: the prompt alone
