"""The OpenAI chat-completions request body: msgspec Structs, validation, and OpenAI-shaped errors.

Decoding and validation run in a tokenizer process, never on the frontend's event loop. msgspec
checks types (its error path becomes the error's ``param``); value ranges are checked by hand so
the messages read like OpenAI's rather than like a schema validator's.

Unknown fields are ignored with one debug log line (OpenAI answers 400; SDKs and agent frameworks send
extras freely, and vLLM ignores them too), but a known parameter that is not served is refused with 400
naming it, never silently ignored. The sampling fields both endpoints share live in
workers/tokenizer/requests/sampling.py.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from ipc.prompts import SamplingParams
from workers.common.errors import BadRequest
from workers.common.tools import ToolChoice, check_tools, parse_tools, tool_grammar
from workers.tokenizer.requests.mm_kwargs import MediaSettings, image_options, request_budget
from workers.tokenizer.requests.sampling import (
    MAX_TOP_LOGPROBS,
    SamplingFields,
    Validate,
    check_sampling,
    range_error,
    refuse_sent,
    to_sampling_params as _to_sampling_params,
    unsupported,
)

__all__ = ["ChatCompletionRequest", "parse_request", "to_sampling_params"]

log = logging.getLogger("glimpse.request")
MAX_UUID_CHARS = 256  # a media part's uuid (workers/tokenizer/media/uuids.py)
_R = TypeVar("_R", bound=msgspec.Struct)


# ---- request structs ---------------------------------------------------------------------------


class ImageURL(msgspec.Struct, frozen=True):
    url: str
    # OpenAI's: "low" scales the image down to 512 px on its longer side before the processor sees it (fewer
    # tokens); "auto" and "high" leave it as sent, at the processor's own resolution. Families with token budgets
    # (Gemma 4) give "low" the smallest and "high" the largest (mm_kwargs.py). Images only.
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(msgspec.Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class ImagePart(msgspec.Struct, frozen=True, tag="image_url", tag_field="type"):
    # Some clients send the URL as a bare string instead of {"url": ...}. None (or left out): the part names media
    # sent before by its ``uuid`` (vLLM's shape: {"type": "image_url", "image_url": null, "uuid": "..."}).
    image_url: ImageURL | str | None = None
    uuid: str | None = None  # the client's id for this media (workers/tokenizer/media/uuids.py)

    @property
    def url(self) -> str | None:
        return self.image_url if isinstance(self.image_url, str) or self.image_url is None else self.image_url.url


class VideoPart(msgspec.Struct, frozen=True, tag="video_url", tag_field="type"):
    # vLLM's and SGLang's shape: {"type": "video_url", "video_url": {"url": ...}} (or the URL as a bare string).
    video_url: ImageURL | str | None = None
    uuid: str | None = None

    @property
    def url(self) -> str | None:
        return self.video_url if isinstance(self.video_url, str) or self.video_url is None else self.video_url.url


class InputAudioPart(msgspec.Struct, frozen=True, tag="input_audio", tag_field="type"):
    input_audio: Any = None  # OpenAI's {"data": ..., "format": ...}: refused, no audio is served


class AudioURLPart(msgspec.Struct, frozen=True, tag="audio_url", tag_field="type"):
    audio_url: Any = None  # vLLM's: refused, no audio is served


ContentPart = TextPart | ImagePart | VideoPart | InputAudioPart | AudioURLPart


class CalledFunction(msgspec.Struct, frozen=True):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; some clients an object


class AssistantToolCall(msgspec.Struct, frozen=True):
    function: CalledFunction
    id: str | None = None
    type: Literal["function"] = "function"


class Message(msgspec.Struct, frozen=True):
    # "developer" is OpenAI's newer name for the system role (sent by the SDK for some models).
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # None: an assistant turn that only called tools
    tool_calls: list[AssistantToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers
    name: str | None = None


class ChatCompletionRequest(SamplingFields, frozen=True, kw_only=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # as sent (the template gets them verbatim); checked by parse_tools
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated predecessors of tools: refused (answering them needs message.function_call).
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM's chat-template controls: continue the last (assistant) message instead of opening a new turn, and more
    # variables for the template (e.g. enable_thinking).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's per-request settings of the multimodal processor (mm_kwargs.py: Gemma 4's max_soft_tokens).
    mm_processor_kwargs: dict[str, Any] | None = None
    # OpenAI's (o-series / gpt-oss templates): handed to the chat template where it reads it, else refused.
    reasoning_effort: str | None = None
    # vLLM's: false leaves the reasoning --reasoning-parser splits off out of the answer (it is still generated).
    include_reasoning: bool = True
    # vLLM's retrieval documents for templates that render them (as reasoning_effort: else refused).
    documents: list[dict[str, Any]] | None = None
    # Fields other servers take that would change the answer and that are not served here: refused unless default.
    echo: bool = False
    audio: Any = None
    modalities: list[str] | None = None
    web_search_options: Any = None
    media_io_kwargs: Any = None  # vLLM's media loaders' per-request options
    best_of: int | None = None
    prompt_logprobs: int | None = None
    chat_template: str | None = None
    add_special_tokens: bool | None = None

    @property
    def tool_mode(self) -> ToolChoice:
        """tool_choice, defaulted as OpenAI does: "auto" with tools, "none" without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_Chat = TypeVar("_Chat", bound=ChatCompletionRequest)

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


def parse_request(body: bytes | memoryview) -> ChatCompletionRequest:
    """Decode and validate a chat-completions body; raises BadRequest with OpenAI-style fields."""
    return parse_with(_decoder, body)


def parse_with(decoder: msgspec.json.Decoder[_Chat], body: bytes | memoryview) -> _Chat:
    """`parse_request` through ``decoder``, of ChatCompletionRequest or a subclass of it."""
    return check_request(decode_body(decoder, body))


def check_request(req: _Chat) -> _Chat:
    """The value checks of a chat request built from another endpoint's body (types are the builder's business)."""
    _check(req)
    return req


_keys = msgspec.json.Decoder(dict[str, msgspec.Raw])


def decode_body(decoder: msgspec.json.Decoder[_R], body: bytes | memoryview) -> _R:
    """Decode ``body`` with ``decoder``, turning every failure into a BadRequest; fields the struct does
    not know are ignored, with one debug line naming them."""
    try:
        req = decoder.decode(body)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: must come first
        raise _validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # msgspec's guard against deep nesting, hit even inside ignored fields
        raise BadRequest("The request body is nested too deeply.", code="invalid_json") from None
    except UnicodeDecodeError:
        raise BadRequest("The request body is not valid UTF-8.", code="invalid_json") from None
    if log.isEnabledFor(logging.DEBUG):  # a second pass over the top level only (values stay raw)
        unknown = sorted(set(_keys.decode(body)) - set(req.__struct_fields__))
        if unknown:
            log.debug("ignoring unknown request fields: %s", ", ".join(unknown))
    return req


def _check(req: ChatCompletionRequest) -> None:
    """Value checks msgspec's types cannot express, in parameter order, first failure wins."""
    _check_parts(req)
    if req.max_tokens is not None and req.max_tokens < 1:
        raise range_error("max_tokens", req.max_tokens, ">= 1")
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise range_error("max_completion_tokens", req.max_completion_tokens, ">= 1")
    check_sampling(req, req.requested_max_tokens)
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise range_error("top_logprobs", req.top_logprobs, f"between 0 and {MAX_TOP_LOGPROBS}")
        if req.top_logprobs > 0 and not req.logprobs:
            raise BadRequest(
                "'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs", code="invalid_value"
            )
    if req.functions is not None or req.function_call is not None:
        raise unsupported("functions", "use 'tools' and 'tool_choice' (the legacy function-call fields are not served)")
    check_tools(parse_tools(req.tools) if req.tools else None, req.tool_choice)
    _check_template(req)
    refuse_sent((
        ("echo", req.echo, "a chat answer does not repeat the prompt (/v1/completions echoes)"),
        ("audio", req.audio is not None, "answers are text only"),
        ("modalities", bool(set(req.modalities or ()) - {"text"}), "answers are text only"),
        ("web_search_options", req.web_search_options is not None, "this server does not search the web"),
        ("media_io_kwargs", bool(req.media_io_kwargs), "a video's frames are chosen by mm_processor_kwargs (fps or "
         "num_frames)"),
        ("best_of", req.best_of not in (None, req.choices), "a chat returns every choice it samples (use n)"),
        ("prompt_logprobs", req.prompt_logprobs is not None, "the prompt's log probabilities are served by "
         "/v1/completions (prompt_logprobs, or echo with logprobs)"),
        ("chat_template", req.chat_template is not None, "the checkpoint's chat template is the one served"),
        ("add_special_tokens", bool(req.add_special_tokens), "the chat template writes every special token"),
    ))


def _check_parts(req: ChatCompletionRequest) -> None:
    for i, message in enumerate(req.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if isinstance(part, InputAudioPart | AudioURLPart):
                kind = "input_audio" if isinstance(part, InputAudioPart) else "audio_url"
                raise unsupported(f"messages[{i}].content[{j}].{kind}", "audio input is not supported")


# apply_chat_template's own parameters: chat_template_kwargs may not set them.
_TEMPLATE_OWN = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                           "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                           "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _check_template(req: ChatCompletionRequest) -> None:
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise BadRequest("'continue_final_message' needs 'add_generation_prompt' set to false.",
                             param="continue_final_message", code="invalid_value")
        if req.messages[-1].role != "assistant":
            raise BadRequest("'continue_final_message' continues the last message, which must be the assistant's.",
                             param="continue_final_message", code="invalid_value")
    if taken := sorted(set(req.chat_template_kwargs or ()) & _TEMPLATE_OWN):
        raise BadRequest(f"'chat_template_kwargs' may not set {', '.join(taken)} (a request field or the server's).",
                         param="chat_template_kwargs", code="invalid_value")


# ---- what the tokenizer needs from a parsed request ---------------------------------------------


@dataclass(frozen=True)
class ImageRef:
    """One image part of the request, in prompt order, with the param path to blame on failure."""

    url: str | None  # None: named by ``uuid`` alone (sent before)
    param: str
    low: bool = False  # detail "low", for families without token budgets: scaled down before the processor
    budget: int | None = None  # the image's token budget (families with budgets; None: the checkpoint's default)
    uuid: str | None = None  # the client's id for the media
    uuid_param: str = ""  # the uuid's param path


def image_refs(req: ChatCompletionRequest, budgets: Sequence[int] = (), settings: MediaSettings | None = None) -> list[ImageRef]:
    """The image parts of the request, in prompt order, with their token budgets for a family whose processor takes
    ``budgets`` (`MMProcessor.budgets`; empty: none), under the request's ``settings`` (`media_settings`; None: read
    here, video keys refused). Raises BadRequest for mm_processor_kwargs the family does not take, even without
    images."""
    budget = settings.budget if settings is not None else request_budget(req.mm_processor_kwargs, budgets)
    return list(_iter_images(req, budget, budgets))


def video_refs(req: ChatCompletionRequest) -> list[ImageRef]:
    """The video parts of the request, in prompt order."""
    refs = []
    for i, message in enumerate(req.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if isinstance(part, VideoPart):
                param = f"messages[{i}].content[{j}].video_url"
                if isinstance(part.video_url, ImageURL) and part.video_url.detail == "low":
                    raise unsupported(f"{param}.detail", "'low' is for images; a video's frames keep their resolution")
                refs.append(ImageRef(part.url, param, uuid=part.uuid, uuid_param=_check_named(part, param, i, j)))
    return refs


def text_parts(req: ChatCompletionRequest) -> list[str]:
    """Every text of the messages, in order (what the prompt's length bound is computed from)."""
    out: list[str] = []
    for message in req.messages:
        if isinstance(message.content, str):
            out.append(message.content)
        elif message.content is not None:
            out.extend(p.text for p in message.content if isinstance(p, TextPart))
    return out


def _iter_images(req: ChatCompletionRequest, budget: int | None, budgets: Sequence[int]) -> Iterator[ImageRef]:
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if isinstance(part, ImagePart):
                    detail = part.image_url.detail if isinstance(part.image_url, ImageURL) else None
                    low, image_budget = image_options(detail, budget, budgets)
                    param = f"messages[{i}].content[{j}].image_url"
                    named = _check_named(part, param, i, j)
                    yield ImageRef(part.url, param, low, image_budget, part.uuid, named)


def _check_named(part: ImagePart | VideoPart, param: str, i: int, j: int) -> str:
    """A media part's uuid param path, once checked: data, a uuid or both (a 400 naming the part without either)."""
    where = f"messages[{i}].content[{j}].uuid"
    if part.uuid is not None:
        if not 0 < len(part.uuid) <= MAX_UUID_CHARS:
            raise BadRequest(f"Invalid '{where}': expected 1 to {MAX_UUID_CHARS} characters.", param=where,
                             code="invalid_value")
    elif part.url is None:
        raise BadRequest(f"Missing required parameter: '{param}' (or a 'uuid' naming media sent before).",
                         param=param, code="missing_required_parameter")
    return where


def tool_parser(req: ChatCompletionRequest, fmt: str = "hermes") -> str:
    """How the scheduler reads the answer when tools may be called: in the format the chat template teaches
    (``fmt``: ChatTemplate.tool_format: "hermes", "qwen_xml" or "gemma4"); "required" and a named choice are held
    to a grammar of JSON calls (tool_grammar), so they are read as such."""
    if not req.tools or req.tool_mode == "none":
        return ""
    return fmt if req.tool_mode == "auto" else "hermes"


def to_sampling_params(
    req: ChatCompletionRequest,
    prompt_len: int,
    max_model_len: int,
    defaults: Mapping[str, float] = {},  # noqa: B006 - read only
    vocab_size: int = 1 << 31,
    validate: Validate | None = None,
    tool_tags: tuple[int | None, int | None] = (None, None),
) -> SamplingParams:
    """Sampling settings of a chat request whose prompt has ``prompt_len`` tokens (see
    workers/tokenizer/requests/sampling.py: context checks, max_tokens clamping, checkpoint defaults)."""
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    tools = parse_tools(req.tools) if req.tools else None
    grammar = tool_grammar(tools, req.tool_mode, req.parallel_tool_calls is not False, tool_tags) if tools else None
    return _to_sampling_params(
        req,
        prompt_len,
        max_model_len,
        requested_max_tokens=req.requested_max_tokens,
        logprobs=logprobs,
        defaults=defaults,
        vocab_size=vocab_size,
        validate=validate,
        structured=(grammar, "tool_choice") if grammar is not None else None,
    )
