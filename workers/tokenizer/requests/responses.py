"""OpenAI's Responses API body (``POST /v1/responses``), served as the chat request it amounts to: ``instructions``
and the ``input`` items become chat messages, so images, tools, structured outputs and the reasoning parser take the
chat path unchanged; the answer is written in the Responses shapes (server/responses_answer.py).

What maps where:
* ``instructions`` -> a leading system message; ``input`` (a string: one user message; or items) -> messages.
  Message items (``type`` "message" or left out): ``content`` a string or parts ``input_text`` / ``output_text`` /
  ``refusal`` (text) and ``input_image`` (``image_url`` a URL or data URL, ``detail``). ``function_call`` items ->
  the assistant's ``tool_calls`` (consecutive calls, and an assistant message just before them, make one turn);
  ``function_call_output`` -> a tool message. ``reasoning`` items of earlier turns are left out, as the Qwen chat
  templates leave out an earlier turn's reasoning.
* ``max_output_tokens`` -> max_completion_tokens; ``text.format`` -> response_format; ``tools`` (function tools,
  flat: ``{"type": "function", "name", "parameters", ...}``) and ``tool_choice`` (``{"type": "function", "name"}``)
  -> the chat shapes; ``reasoning.effort`` -> reasoning_effort; ``top_logprobs`` or ``include``
  ``message.output_text.logprobs`` -> logprobs. vLLM's sampling extensions (top_k, seed, stop, ...) as in chat.
* Not served, a 400 naming the field: ``previous_response_id``, ``conversation``, ``prompt`` and ``item_reference``
  items (nothing is stored: send the conversation in ``input``), ``background``, ``truncation`` "auto",
  ``max_tool_calls``, built-in tools (web search, file search, ...), ``input_file`` parts, and chat-only fields sent
  here (``messages``, ``n``, ``max_tokens``, ``response_format``, ...). ``store`` is accepted; the Response says
  ``store: false``.

A refusal the chat path raises names the Responses field (``responses_names``).
"""

from __future__ import annotations

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
from workers.tokenizer.requests.sampling import MAX_TOP_LOGPROBS, range_error, unsupported
from workers.tokenizer.requests.structured import JsonSchemaFormat, ResponseFormat, StructuredOutputs

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(msgspec.Struct, frozen=True, tag="input_text", tag_field="type"):
    text: str


class OutputText(msgspec.Struct, frozen=True, tag="output_text", tag_field="type"):
    text: str
    annotations: Any = None
    logprobs: Any = None


class Refusal(msgspec.Struct, frozen=True, tag="refusal", tag_field="type"):
    refusal: str


class InputImage(msgspec.Struct, frozen=True, tag="input_image", tag_field="type"):
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None
    file_id: str | None = None


class InputFile(msgspec.Struct, frozen=True, tag="input_file", tag_field="type"):
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


class InputAudio(msgspec.Struct, frozen=True, tag="input_audio", tag_field="type"):
    input_audio: Any = None


InputPart = InputText | OutputText | Refusal | InputImage | InputFile | InputAudio


class InputItem(msgspec.Struct, frozen=True):
    """One ``input`` item; which fields it needs depends on ``type`` (checked in ``_messages``)."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    output: str | list[InputPart] | None = None  # function_call_output
    id: str | None = None
    status: str | None = None
    summary: Any = None  # reasoning
    encrypted_content: Any = None  # reasoning


class TextFormat(msgspec.Struct, frozen=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, frozen=True):
    format: TextFormat | None = None
    verbosity: Any = None


class Reasoning(msgspec.Struct, frozen=True):
    effort: str | None = None
    summary: str | None = None  # a summary of the reasoning: the answer carries the reasoning text itself instead
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    input: str | list[InputItem]
    instructions: str | list[InputPart] | None = None
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # Taken and not passed on: they shape nothing of the answer here.
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: Any = None
    # Not served (a 400 naming them unless left out).
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    # vLLM's sampling and processor extensions, as the chat endpoint takes them.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    # Chat-completions fields sent here: refused, each would change the answer and has its Responses name.
    messages: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    n: Any = None
    response_format: Any = None
    logprobs: Any = None


_decoder = msgspec.json.Decoder(ResponsesRequest)
# Chat fields a Responses body may not send -> the Responses field that does the job.
_CHAT_ONLY = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
              "n": None, "response_format": "text.format", "logprobs": "top_logprobs or include"}  # fmt: skip


def parse_responses(body: bytes | memoryview) -> tuple[ChatCompletionRequest, bytes]:
    """The chat request a Responses body amounts to, and the fields its Response object repeats (JSON). Raises
    BadRequest; ``responses_names`` names its param as the body does."""
    req = decode_body(_decoder, body)
    _refuse(req)
    messages, _ = _messages(req)
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        schema = JsonSchemaFormat(fmt.name, fmt.schema, fmt.strict, fmt.description) if fmt.type == "json_schema" else None
        response_format = ResponseFormat(fmt.type, schema)
    logprobs = req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or ())
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, stream=req.stream,  # a stream's usage rides in response.completed
        max_completion_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        tools=[_chat_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
        tool_choice=_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format, logprobs=logprobs or None,
        top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
        top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, logit_bias=req.logit_bias,
        skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
        structured_outputs=req.structured_outputs, mm_processor_kwargs=req.mm_processor_kwargs,
        chat_template_kwargs=req.chat_template_kwargs, cache_salt=req.cache_salt, user=req.user,
    )  # fmt: skip
    return check_request(chat), _repeated(req)


def _repeated(req: ResponsesRequest) -> bytes:
    """The request's settings as the Response object states them (OpenAI's defaults where the body left them out)."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else TextFormat("text")
    text = {"type": "text"} if fmt.type == "text" else msgspec.to_builtins(fmt)
    if fmt.type == "json_object":
        text = {"type": "json_object"}
    reasoning = {"effort": req.reasoning.effort, "summary": None} if req.reasoning is not None else None
    return msgspec.json.encode({
        "instructions": msgspec.to_builtins(req.instructions), "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": reasoning, "store": False, "temperature": req.temperature,
        "text": {"format": text}, "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "top_logprobs": req.top_logprobs, "top_p": req.top_p, "truncation": "disabled",
        "user": req.user, "background": False,
    })  # fmt: skip


def _refuse(req: ResponsesRequest) -> None:
    for name, instead in _CHAT_ONLY.items():
        if getattr(req, name) is not None:
            why = f"it is a chat-completions field; send '{instead}'" if instead else "a response has one answer"
            raise refused_as_sent(unsupported(name, why))  # the body's own field, not a chat field to rename
    stored = "responses are not stored; send the whole conversation in 'input'"
    for name, sent, why in (
        ("previous_response_id", req.previous_response_id is not None, stored),
        ("conversation", req.conversation is not None, stored),
        ("prompt", req.prompt is not None, "stored prompt templates are not served"),
        ("background", bool(req.background), "responses are answered in the foreground"),
        ("truncation", req.truncation == "auto", "the input is not truncated; a too-long one is a 400"),
        ("max_tool_calls", req.max_tool_calls is not None, "built-in tools are not served"),
        ("text.verbosity", req.text is not None and req.text.verbosity not in (None, "medium"),
         "an answer's length is not steered apart from max_output_tokens"),
        ("reasoning.summary", req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary)
         not in (None, "auto"), "reasoning is returned as text (with --reasoning-parser), not summarized"),
    ):
        if sent:
            raise unsupported(name, why)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise range_error("top_logprobs", req.top_logprobs, f"between 0 and {MAX_TOP_LOGPROBS}")
    for i, item in enumerate(req.include or ()):
        if item != LOGPROBS_INCLUDE:
            raise unsupported(f"include[{i}]", f"only {LOGPROBS_INCLUDE!r} is served")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise range_error("max_output_tokens", req.max_output_tokens, ">= 1")


def _parts(parts: str | list[InputPart], param: str) -> str | list[ContentPart]:
    if isinstance(parts, str):
        return parts
    out: list[ContentPart] = []
    for j, part in enumerate(parts):
        where = f"{param}[{j}]"
        if isinstance(part, InputText | OutputText):
            out.append(TextPart(part.text))
        elif isinstance(part, Refusal):
            out.append(TextPart(part.refusal))
        elif isinstance(part, InputImage):
            if part.image_url is None:
                why = "uploaded files are not served; send the image as image_url (a URL or data URL)"
                raise unsupported(f"{where}.file_id", why) if part.file_id else BadRequest(
                    f"Missing required parameter: '{where}.image_url'.", param=f"{where}.image_url",
                    code="missing_required_parameter")  # fmt: skip
            out.append(ImagePart(ImageURL(part.image_url, part.detail)))
        else:
            kind = "input_file" if isinstance(part, InputFile) else "input_audio"
            raise unsupported(f"{where}.type", f"{kind} parts are not served (text and images are)")
    return out


# For each chat message: the Responses param it came from, the name its content has there, and the params of its tool
# calls (a refusal's names).
Origins = list[tuple[str, str, list[str]]]


def _messages(req: ResponsesRequest) -> tuple[list[Message], Origins]:
    """The chat messages of the body, and where each came from."""
    messages: list[Message] = []
    origins: Origins = []
    if req.instructions is not None:
        messages.append(Message("system", _parts(req.instructions, "instructions")))
        origins.append(("instructions", "", []))
    if isinstance(req.input, str):
        messages.append(Message("user", req.input))
        origins.append(("input", "", []))
        return messages, origins
    if not req.input:
        raise range_error("input", [], "that is a string or a non-empty list of items")
    for k, item in enumerate(req.input):
        where = f"input[{k}]"
        if item.type == "message":
            if item.role is None or item.content is None:
                field = "role" if item.role is None else "content"
                raise BadRequest(f"Missing required parameter: '{where}.{field}'.", param=f"{where}.{field}",
                                 code="missing_required_parameter")  # fmt: skip
            messages.append(Message(item.role, _parts(item.content, f"{where}.content")))
            origins.append((where, ".content", []))
        elif item.type == "function_call":
            if item.name is None or item.call_id is None:
                field = "name" if item.name is None else "call_id"
                raise BadRequest(f"Missing required parameter: '{where}.{field}'.", param=f"{where}.{field}",
                                 code="missing_required_parameter")  # fmt: skip
            call = AssistantToolCall(CalledFunction(item.name, item.arguments or "{}"), item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and origins[-1][0].startswith("input"):
                messages[-1] = msgspec.structs.replace(last, tool_calls=[*(last.tool_calls or []), call])
                origins[-1][2].append(where)
            else:
                messages.append(Message("assistant", None, tool_calls=[call]))
                origins.append((where, ".content", [where]))
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                field = "call_id" if item.call_id is None else "output"
                raise BadRequest(f"Missing required parameter: '{where}.{field}'.", param=f"{where}.{field}",
                                 code="missing_required_parameter")  # fmt: skip
            messages.append(Message("tool", _parts(item.output, f"{where}.output"), tool_call_id=item.call_id))
            origins.append((where, ".output", []))
        elif item.type == "reasoning":
            continue  # an earlier turn's reasoning: the templates drop it (see the module's docstring)
        elif item.type == "item_reference":
            raise unsupported(f"{where}.type", "responses are not stored; send the items themselves")
        else:
            raise unsupported(f"{where}.type", f"{item.type!r} items are not served (message, function_call, "
                              "function_call_output and reasoning are)")
    if not messages:
        raise range_error("input", "only reasoning items", "with at least one message")
    return messages, origins


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as the chat shape the chat template and the checks take."""
    kind = tool.get("type")
    if kind != "function":
        raise unsupported(f"tools[{i}].type", f"{kind!r} tools are not served (function tools are)")
    if "function" in tool:  # already the chat shape: some clients send it here too
        return tool
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any] | None) -> ToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise range_error("tool_choice", choice, "of 'none', 'auto', 'required' or a named function")
        return choice  # type: ignore[return-value]
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedToolChoice("function", NamedFunction(choice["name"]))
    raise unsupported("tool_choice", "only 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")


def responses_names(exc: BadRequest, body: bytes | memoryview) -> BadRequest:
    """A refusal of the chat request a Responses ``body`` became, with its param in the body's own names."""
    param = exc.param
    if param is None or isinstance(exc, BodyFieldRefused):
        return exc
    head, dot, rest = param.partition(".")
    if m := _MESSAGE.match(param):
        try:
            origin, content, calls = _messages(_decoder.decode(body))[1][int(m["message"])]
        except (BadRequest, msgspec.DecodeError, IndexError, RecursionError, UnicodeDecodeError):
            origin, content, calls = "input", "", []
        tail = m["tail"]
        if (call := _CALL.match(tail)) and int(call["call"]) < len(calls):  # a function_call item's name, arguments
            name = calls[int(call["call"])] + call["field"].removeprefix(".function")
        elif tail.startswith(".content"):
            name = origin + content + tail.removeprefix(".content")
        else:
            name = origin + tail.replace(".tool_call_id", ".call_id")
    elif head.startswith("tools[") and rest.startswith("function."):
        name = head + "." + rest.removeprefix("function.")
    elif head == "response_format":  # its json_schema's keys sit in text.format itself
        name = "text.format" + ("." + rest.partition(".")[2] if rest.startswith("json_schema.") else "")
    else:
        name = _RESPONSES_NAME.get(head, param)
    return exc if name == param else renamed(exc, name)


_MESSAGE = re.compile(r"^messages\[(?P<message>\d+)\](?P<tail>.*)$")
_CALL = re.compile(r"^\.tool_calls\[(?P<call>\d+)\](?P<field>.*)$")
_RESPONSES_NAME = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                   "response_format": "text.format", "reasoning_effort": "reasoning.effort",
                   "logprobs": "top_logprobs", "messages": "input"}  # fmt: skip
