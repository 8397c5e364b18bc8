"""Anthropic's Messages API body (``POST /v1/messages``, what the anthropic SDK and Claude-style agents send), served
as the chat request it amounts to; the answer is written in Anthropic's shapes (server/messages_answer.py).

What maps where: ``system`` (a string or text blocks) -> a leading system message; ``messages`` -> chat messages, with
blocks ``text``, ``image`` (``source`` ``{"type": "base64", "media_type", "data"}`` or ``{"type": "url", "url"}``),
an assistant's ``tool_use`` (-> its tool_calls, ``input`` as the arguments' JSON) and a user's ``tool_result`` (-> a
tool message, before the turn's other blocks); an assistant's earlier ``thinking`` blocks are left out, as the Qwen
templates leave out an earlier turn's reasoning. ``max_tokens`` (required), ``temperature``, ``top_p``, ``top_k``,
``stop_sequences`` -> stop, ``tools`` (``input_schema`` -> parameters), ``tool_choice`` (auto, any -> required,
tool -> named, none; ``disable_parallel_tool_use``), ``metadata.user_id`` -> user, ``thinking`` ``{"type":
"disabled"}`` -> the template's ``enable_thinking`` false, ``enabled`` -> true, its ``budget_tokens`` the reasoning's
token budget (vLLM's thinking_token_budget, with --reasoning-parser); a final assistant turn is a prefill the answer
continues (``continue_final_message``). Not served, a 400 naming the field: server tools (``type`` other than
custom), ``document`` and ``search_result`` blocks, ``container``, ``mcp_servers``.
A refusal the chat path raises later names the Messages field (``messages_names``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec

from workers.common.errors import BadRequest
from workers.common.tools import NamedFunction, NamedToolChoice, ToolChoice
from workers.tokenizer.requests.chat import (
    AssistantToolCall,
    CalledFunction,
    ChatCompletionRequest,
    ContentPart,
    ImagePart,
    ImageURL,
    Message,
    TextPart,
    check_request,
    decode_body,
)
from workers.tokenizer.requests.image_data import renamed
from workers.tokenizer.requests.native_body import BodyFieldRefused, refused_as_sent
from workers.tokenizer.requests.sampling import range_error, unsupported


class Block(msgspec.Struct, frozen=True):
    """One content block; which fields it needs depends on ``type`` (checked in ``_content``)."""

    type: str
    text: str | None = None
    source: dict[str, Any] | None = None  # image
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: Any = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None
    signature: str | None = None
    cache_control: Any = None  # a prompt-caching hint: glimpse caches every prefix anyway


class AnthropicMessage(msgspec.Struct, frozen=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolChoiceBlock(msgspec.Struct, frozen=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, frozen=True):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    max_tokens: int | None = None  # required, except to count tokens (``/v1/messages/count_tokens``)
    messages: list[AnthropicMessage]
    system: str | list[Block] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceBlock | None = None
    metadata: dict[str, Any] | None = None
    thinking: Thinking | None = None
    service_tier: str | None = None  # taken, changes nothing here
    container: Any = None
    mcp_servers: Any = None


_decoder = msgspec.json.Decoder(MessagesRequest)
_SERVER_TOOL = "server tools (web search, code execution, ...) are not served; send custom tools (name, input_schema)"


def parse_messages(body: bytes | memoryview, count: bool = False) -> ChatCompletionRequest:
    """The chat request an Anthropic Messages body amounts to (raises BadRequest; ``messages_names`` names its param
    as the body does). ``count``: a count_tokens body, which has no ``max_tokens`` (the prompt alone is counted)."""
    try:
        req = decode_body(_decoder, body)
        if req.max_tokens is None:
            if not count:
                raise BadRequest("Missing required parameter: 'max_tokens'.", param="max_tokens",
                                 code="missing_required_parameter")
            req = msgspec.structs.replace(req, max_tokens=1)
        chat = _chat(req)
    except BodyFieldRefused:
        raise
    except BadRequest as exc:  # already in the body's names (both have a "messages"): kept from renaming
        raise refused_as_sent(exc) from None
    return check_request(chat)


def _chat(req: MessagesRequest) -> ChatCompletionRequest:
    for name, value in (("container", req.container), ("mcp_servers", req.mcp_servers)):
        if value is not None:
            raise refused_as_sent(unsupported(name, "not served"))
    if req.max_tokens is None or req.max_tokens < 1:
        raise range_error("max_tokens", req.max_tokens, ">= 1")
    kwargs, budget = None, None
    if req.thinking is not None:
        if req.thinking.type == "disabled":
            kwargs = {"enable_thinking": False}
        else:  # enabled, its budget enforced as vLLM's thinking_token_budget (which needs --reasoning-parser)
            kwargs, budget = {"enable_thinking": True}, req.thinking.budget_tokens
    choice = req.tool_choice
    user = req.metadata.get("user_id") if req.metadata else None
    messages = _messages(req)[0]
    # A final assistant turn is a prefill: Anthropic's answer continues its text rather than opening a new turn.
    prefill = messages[-1].role == "assistant"
    if prefill and messages[-1].tool_calls:
        where = f"messages[{len(req.messages) - 1}]"
        raise refused_as_sent(BadRequest(
            f"Invalid '{where}': a final assistant turn is continued as a prefill, which a tool_use cannot be; send "
            "its tool_result blocks in a user turn after it.", param=where, code="invalid_value"))
    return ChatCompletionRequest(
        model=req.model, messages=messages, stream=req.stream, max_tokens=req.max_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences,
        tools=[_chat_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
        tool_choice=_tool_choice(choice), user=user if isinstance(user, str) else None,
        parallel_tool_calls=False if choice is not None and choice.disable_parallel_tool_use else None,
        chat_template_kwargs=kwargs, add_generation_prompt=not prefill, continue_final_message=prefill,
        thinking_token_budget=budget,
    )  # fmt: skip


def _image(block: Block, where: str) -> ImagePart:
    source = block.source or {}
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return ImagePart(ImageURL(f"data:{source['media_type']};base64,{source['data']}"))
    if kind == "url" and isinstance(source.get("url"), str):
        return ImagePart(ImageURL(source["url"]))
    raise range_error(f"{where}.source", source, "of type base64 (media_type, data) or url (url)")


def _parts(blocks: str | list[Block], where: str) -> str | list[ContentPart]:
    if isinstance(blocks, str):
        return blocks
    out: list[ContentPart] = []
    for j, block in enumerate(blocks):
        if block.type == "text":
            out.append(TextPart(block.text or ""))
        elif block.type == "image":
            out.append(_image(block, f"{where}[{j}]"))
        else:
            raise unsupported(f"{where}[{j}].type", f"{block.type!r} blocks are not served here (text and images are)")
    return out


# Per chat message: the Messages param it came from (a refusal's name), and for a list content the block each part
# came from.
Origins = list[tuple[str, list[int]]]


def _messages(req: MessagesRequest) -> tuple[list[Message], Origins]:
    messages: list[Message] = []
    origins: Origins = []
    if req.system is not None:
        messages.append(Message("system", _parts(req.system, "system")))
        origins.append(("system", list(range(len(req.system))) if isinstance(req.system, list) else []))
    if not req.messages:
        raise range_error("messages", [], "with at least one message")
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(message.content, str):
            messages.append(Message(message.role, message.content))
            origins.append((f"{where}.content", []))
            continue
        parts: list[ContentPart] = []  # a turn's tool results go first, as tool messages, then its other blocks
        kept: list[int] = []
        calls: list[AssistantToolCall] = []
        for j, block in enumerate(message.content):
            at = f"{where}.content[{j}]"
            if block.type == "tool_use" and message.role == "assistant":
                if block.id is None or block.name is None:
                    field = "id" if block.id is None else "name"
                    raise BadRequest(f"Missing required parameter: '{at}.{field}'.", param=f"{at}.{field}",
                                     code="missing_required_parameter")  # fmt: skip
                if block.input is not None and not isinstance(block.input, dict):
                    raise range_error(f"{at}.input", block.input, "that is an object (the tool's arguments)")
                calls.append(AssistantToolCall(CalledFunction(block.name, json.dumps(block.input or {})), block.id))
            elif block.type == "tool_result" and message.role == "user":
                if block.tool_use_id is None:
                    raise BadRequest(f"Missing required parameter: '{at}.tool_use_id'.", param=f"{at}.tool_use_id",
                                     code="missing_required_parameter")  # fmt: skip
                result = _parts(block.content if block.content is not None else "", f"{at}.content")
                messages.append(Message("tool", result, tool_call_id=block.tool_use_id))
                origins.append((f"{at}.content", list(range(len(block.content))) if isinstance(block.content, list) else []))
            elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # an earlier turn's reasoning (see the module's docstring)
            else:
                parts.extend(_one(block, at))
                kept.append(j)
        results_only = not (parts or calls) and any(b.type == "tool_result" for b in message.content)
        if not results_only:  # (a user turn of tool results alone is those tool messages)
            messages.append(Message(message.role, parts or (None if calls else ""), tool_calls=calls or None))
            origins.append((f"{where}.content", kept))
    return messages, origins


def _one(block: Block, at: str) -> list[ContentPart]:
    if block.type == "text":
        return [TextPart(block.text or "")]
    if block.type == "image":
        return [_image(block, at)]
    raise unsupported(f"{at}.type", f"{block.type!r} blocks are not served here (text, image, tool_use and "
                      "tool_result are)")  # fmt: skip


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    kind = tool.get("type", "custom")
    if kind not in ("custom", None) or "input_schema" not in tool:
        raise unsupported(f"tools[{i}].type", _SERVER_TOOL)
    # In OpenAI's key order: the chat template writes the tools as JSON, keys as they come.
    function = {"name": tool.get("name"), **({"description": tool["description"]} if "description" in tool else {}),
                "parameters": tool["input_schema"]}
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoiceBlock | None) -> ToolChoice | None:
    if choice is None or choice.type == "auto":
        return None if choice is None else "auto"
    if choice.type == "none":
        return "none"
    if choice.type == "any":
        return "required"
    if choice.name is None:
        raise BadRequest("Missing required parameter: 'tool_choice.name'.", param="tool_choice.name",
                         code="missing_required_parameter")  # fmt: skip
    return NamedToolChoice("function", NamedFunction(choice.name))


def messages_names(exc: BadRequest, body: bytes | memoryview) -> BadRequest:
    """A refusal of the chat request a Messages ``body`` became, with its param in the body's own names."""
    param = exc.param
    if param is None or isinstance(exc, BodyFieldRefused):
        return exc
    name = param
    if m := _MESSAGE.match(param):
        try:
            origin, kept = _messages(_decoder.decode(body))[1][int(m["message"])]
        except (BadRequest, msgspec.DecodeError, IndexError, RecursionError, UnicodeDecodeError):
            origin, kept = "messages", []
        tail = m["tail"]
        if (part := _PART.match(tail)) and int(part["part"]) < len(kept):  # a block of a list content
            rest = part["rest"]  # an image block's picture is its source, where chat's part holds an image_url
            name = f"{origin}[{kept[int(part['part'])]}]{'.source' if rest.startswith('.image_url') else rest}"
        elif tail.startswith(".content"):  # the content itself (a string)
            name = origin + tail.removeprefix(".content")
        elif tail.startswith(".tool_calls["):  # an assistant's tool_use block
            name = origin.removesuffix(".content")
        else:
            name = origin.removesuffix(".content") + tail
    elif param.startswith("tools[") and ".function." in param:
        name = param.replace(".function.parameters", ".input_schema").replace(".function.", ".")
    elif param in _RENAMED:
        name = _RENAMED[param]
    return exc if name == param else renamed(exc, name)


_RENAMED = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "thinking_token_budget": "thinking.budget_tokens"}
_MESSAGE = re.compile(r"^messages\[(?P<message>\d+)\](?P<tail>.*)$")
_PART = re.compile(r"^\.content\[(?P<part>\d+)\](?P<rest>.*)$")
