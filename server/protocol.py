"""OpenAI response shapes the frontend writes (msgspec Structs), their encoders and SSE framing.

Only *responses* live here: request bodies are parsed by the tokenizer workers, never on the
event loop. Field order follows OpenAI's own payloads so clients and diff-based tests see the
familiar layout.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Send

from ipc.control import RequestFailed
from ipc.logprob_messages import TokenLogprob

_encoder = msgspec.json.Encoder()

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # Reverse proxies (nginx) buffer responses by default, which would hold back every token.
    (b"x-accel-buffering", b"no"),
]
JSON_HEADERS: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]


def encode(obj: object) -> bytes:
    return _encoder.encode(obj)


def sse_event(data: bytes) -> bytes:
    """One server-sent event carrying `data` (a JSON document: it never contains a raw newline)."""
    return b"data: " + data + b"\n\n"


# ---- errors --------------------------------------------------------------------------------------


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


def error_payload(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> bytes:
    return encode(ErrorResponse(ErrorBody(message=message, type=type, param=param, code=code)))


def failed_payload(failed: RequestFailed) -> bytes:
    return error_payload(failed.message, failed.type, failed.param, failed.code)


def is_json(content_type: str) -> bool:
    """A JSON media type, or none at all (clients that send a bare body); parameters are ignored."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("", "application/json") or media.endswith("+json")


def error_response(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    body = error_payload(message, type, param, code)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


async def send_json(send: Send, status: int, body: bytes) -> None:
    """A whole JSON response over raw ASGI (for handlers that own `send`)."""
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ---- chat completion (non-streaming) -------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int  # --reasoning-parser: completion tokens of the reasoning (workers/common/reasoning.py)


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # only with a reasoning parser

    @staticmethod
    def of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int | None = None) -> Usage:
        total = prompt_tokens + completion_tokens
        details = CompletionTokensDetails(reasoning_tokens) if reasoning_tokens is not None else None
        return Usage(prompt_tokens, completion_tokens, total, PromptTokensDetails(cached_tokens), details)


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob] | None
    refusal: None = None


class FunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | None  # null (present) when the answer is tool calls only, as OpenAI sends it
    # --reasoning-parser: the reasoning under both names clients read (SGLang and older vLLM: reasoning_content;
    # newer vLLM: reasoning); absent without a parser.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []  # absent when there are none


class Choice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    # vLLM's: the stop string or stop_token_ids entry that ended the choice; null otherwise (an end token included).
    stop_reason: str | int | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    # kw_only lets defaulted fields sit where OpenAI puts them.
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: None = None


# vLLM's return_token_ids: the same objects with the ids beside (only then: other answers keep OpenAI's keys).
class ChoiceWithIds(Choice):
    token_ids: list[int] = []


class ChatCompletionWithIds(ChatCompletion, kw_only=True):
    prompt_token_ids: list[int]


# ---- chat completion chunks (streaming) ----------------------------------------------------------


class ToolCallDeltaOut(msgspec.Struct, omit_defaults=True):
    # The first delta of a call carries id, type and name; later ones only argument text.
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCall | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    # Absent keys, not nulls: OpenAI sends the role once and then bare content deltas.
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning-parser, as in AssistantMessage
    reasoning: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None  # present as null until the last chunk, as OpenAI does
    logprobs: ChoiceLogprobs | None = None
    stop_reason: str | int | None = None  # vLLM's, as in Choice: set on the finishing chunk


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    # No defaults on the fields that must always appear: omit_defaults would drop them.
    id: str
    object: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # only on the include_usage chunk
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk (vLLM's)


class ChunkChoiceWithIds(ChunkChoice):
    token_ids: list[int] = []  # return_token_ids: the chunk's new ids


def error_event(failed: RequestFailed) -> bytes:
    """A mid-stream failure: the status line is long gone, so the error travels as an event."""
    return sse_event(failed_payload(failed))


# ---- models --------------------------------------------------------------------------------------


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "glimpse"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class BodyTooLarge(Exception):
    """A request body over its endpoint's limit (413)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (BodyTooLarge) as soon as it passes ``limit`` bytes: by its Content-Length before a
    byte is read, or while a chunked upload, which has none, arrives."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)
