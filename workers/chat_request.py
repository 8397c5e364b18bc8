"""The OpenAI chat-completions request body: msgspec Structs, validation, and OpenAI-shaped errors.

Decoding and validation run in a tokenizer process, never on the frontend's event loop. msgspec
checks types (its error path becomes the error's ``param``); value ranges are checked by hand so
the messages read like OpenAI's rather than like a schema validator's.

Unknown fields are ignored (OpenAI answers 400; SDKs and agent frameworks send extras freely), but
known parameters that would silently change the answer if ignored (``n`` > 1, penalties, logprobs,
tools) are refused with 400 naming the parameter.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from ipc.messages import RequestFailed, SamplingParams

MAX_STOP_STRINGS = 16  # OpenAI allows 4; stop strings are cheap for us, so allow a few more


class BadRequest(Exception):
    """A request the server refuses, carrying the OpenAI error object's fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def to_failed(self, rid: str) -> RequestFailed:
        return RequestFailed(rid, self.status, self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return f"BadRequest({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


# ---- request structs ---------------------------------------------------------------------------


class ImageURL(msgspec.Struct, frozen=True):
    url: str
    detail: str | None = None  # accepted for compatibility; the processor's own resizing decides


class TextPart(msgspec.Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class ImagePart(msgspec.Struct, frozen=True, tag="image_url", tag_field="type"):
    # Some clients send the URL as a bare string instead of {"url": ...}.
    image_url: ImageURL | str

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = TextPart | ImagePart


class Message(msgspec.Struct, frozen=True):
    # "developer" is OpenAI's newer name for the system role (sent by the SDK for some models).
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None  # None: an assistant turn that only called tools


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # null is what several SDKs send for "default", so every knob takes None.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM-style extension: 0 or -1 disable it
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM-style extension
    ignore_eos: bool = False  # vLLM-style extension, for benchmarks
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


_decoder = msgspec.json.Decoder(ChatCompletionRequest)

# msgspec error texts end in " - at `$.messages[0].content`"; missing fields are named in the text.
_PATH_RE = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING_RE = re.compile(r"missing required field `(?P<field>[^`]+)`")


def _validation_error(exc: msgspec.ValidationError) -> BadRequest:
    m = _PATH_RE.match(str(exc))
    what, path = (m.group("what"), m.group("path") or "") if m else (str(exc), "")
    missing = _MISSING_RE.search(what)
    if missing:
        field = f"{path}.{missing.group('field')}".removeprefix(".")
        return BadRequest(
            f"Missing required parameter: '{field}'.", param=field, code="missing_required_parameter"
        )
    param = path.removeprefix(".") or None
    # msgspec writes `type` in backticks; plain quotes read better in an API error.
    where = f"Invalid value for '{param}'" if param else "Invalid request body"
    return BadRequest(f"{where}: {what.replace('`', '')}", param=param, code="invalid_value")


def parse_request(body: bytes) -> ChatCompletionRequest:
    """Decode and validate a chat-completions body; raises BadRequest with OpenAI-style fields."""
    try:
        req = _decoder.decode(body)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: must come first
        raise _validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    _check(req)
    return req


def _range_error(param: str, value: object, expected: str) -> BadRequest:
    return BadRequest(
        f"Invalid '{param}': expected a value {expected}, but got {value!r} instead.",
        param=param,
        code="invalid_value",
    )


def _unsupported(param: str, why: str) -> BadRequest:
    return BadRequest(f"'{param}' is not supported: {why}", param=param, code="unsupported_parameter")


def _check(req: ChatCompletionRequest) -> None:
    """Value checks msgspec's types cannot express, in parameter order, first failure wins."""
    if req.max_tokens is not None and req.max_tokens < 1:
        raise _range_error("max_tokens", req.max_tokens, ">= 1")
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise _range_error("max_completion_tokens", req.max_completion_tokens, ">= 1")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise _range_error("temperature", req.temperature, "between 0 and 2")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise _range_error("top_p", req.top_p, "in (0, 1]")
    if req.top_k is not None and req.top_k < -1:
        raise _range_error("top_k", req.top_k, ">= -1 (-1 or 0 disable top-k)")
    stops = req.stop_strings
    if len(stops) > MAX_STOP_STRINGS:
        raise _range_error("stop", f"{len(stops)} strings", f"of at most {MAX_STOP_STRINGS} strings")
    if any(not s for s in stops):
        raise _range_error("stop", "", "that is a non-empty string")
    if req.n is not None and req.n != 1:
        raise _unsupported("n", "only n=1 is served")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and value != 0:
            raise _unsupported(name, "only 0 is accepted")
    if req.logprobs or req.top_logprobs:
        raise _unsupported("logprobs", "log probabilities are not returned")
    if req.logit_bias:
        raise _unsupported("logit_bias", "logit biases are not applied")
    if req.tools:
        raise _unsupported("tools", "tool calling is not served")


# ---- what the tokenizer needs from a parsed request ---------------------------------------------


@dataclass(frozen=True)
class ImageRef:
    """One image part of the request, in prompt order, with the param path to blame on failure."""

    url: str
    param: str


def image_refs(req: ChatCompletionRequest) -> list[ImageRef]:
    return list(_iter_images(req))


def _iter_images(req: ChatCompletionRequest) -> Iterator[ImageRef]:
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if isinstance(part, ImagePart):
                    yield ImageRef(part.url, f"messages[{i}].content[{j}].image_url")


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages in the shape `MMProcessor.render` takes; image parts become bare placeholders."""
    out: list[dict[str, Any]] = []
    for message in req.messages:
        role = "system" if message.role == "developer" else message.role
        raw = message.content
        content: str | list[dict[str, Any]]
        if raw is None or isinstance(raw, str):
            content = raw or ""
        else:
            content = [
                {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image_url"}
                for p in raw
            ]
        out.append({"role": role, "content": content})
    return out


def to_sampling_params(req: ChatCompletionRequest, prompt_len: int, max_model_len: int) -> SamplingParams:
    """Sampling settings for a prompt of `prompt_len` tokens.

    A prompt that leaves no room for one new token is refused (context_length_exceeded); otherwise
    max_tokens defaults to, and is clamped to, the room left in the context window, so a client
    asking for "as much as possible" with a large max_tokens still gets an answer.
    """
    if prompt_len >= max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your messages "
            f"resulted in {prompt_len} tokens. Please reduce the length of the messages or images.",
            param="messages",
            code="context_length_exceeded",
        )
    room = max_model_len - prompt_len
    requested = req.requested_max_tokens
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return SamplingParams(
        max_tokens=room if requested is None else min(requested, room),
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=top_k,
        seed=req.seed,
        stop=req.stop_strings,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )
