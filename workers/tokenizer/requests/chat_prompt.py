"""A parsed chat request as the chat template takes it (``ChatTemplate.render``): the messages (image and video
parts as bare placeholders), the tools, and apply_chat_template's options. The generation, the render route and
/tokenize all go through these, so one request renders the same prompt on each; the first two through
``chat_prompt``, which also names what a template refused."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jinja2

from workers.common.errors import BadRequest
from workers.tokenizer.requests.chat import (
    ChatCompletionRequest,
    ContentPart,
    ImagePart,
    TextPart,
    VideoPart,
)
from workers.tokenizer.requests.sampling import unsupported

if TYPE_CHECKING:
    from workers.engine.prompt.chat_template import Rendered
    from workers.engine.prompt.media_items import ImageMeta, Prompt
    from workers.engine.prompt.processor import MMProcessor
    from workers.engine.prompt.video_prompt import VideoMeta


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages in the shape `MMProcessor.render` takes; image parts become bare placeholders."""
    out: list[dict[str, Any]] = []
    for message in req.messages:
        role = "system" if message.role == "developer" else message.role
        raw = message.content
        content: str | list[dict[str, Any]] | None
        if raw is None and message.tool_calls:
            content = None  # as the client sent it: templates test it before writing a newline
        elif raw is None or isinstance(raw, str):
            content = raw or ""
        else:
            content = [_template_part(p) for p in raw]
        entry: dict[str, Any] = {"role": role, "content": content}
        if message.tool_calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in message.tool_calls
            ]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _template_part(part: ContentPart) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    if isinstance(part, VideoPart):
        return {"type": "video_url"}
    if isinstance(part, ImagePart):
        return {"type": "image_url"}
    raise ValueError(f"a {type(part).__name__} reached the template (parse_request refuses them)")


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools for the chat template (None: the template renders no tool section)."""
    return list(req.tools) if req.tools else None


def template_options(req: ChatCompletionRequest, reads: Callable[[str], bool]) -> dict[str, Any]:
    """apply_chat_template's keyword arguments for this request, beside the messages and tools. ``reads``: whether
    the checkpoint's chat template reads a variable; ``reasoning_effort`` and ``documents`` go to one that does and
    are refused by one that does not (they would change nothing, silently)."""
    extra: dict[str, Any] = {}
    if req.reasoning_effort is not None:
        if not reads("reasoning_effort"):
            raise unsupported("reasoning_effort", "this model's chat template takes none (where a model can turn "
                              "its thinking off, chat_template_kwargs does, e.g. {\"enable_thinking\": false})")
        extra["reasoning_effort"] = req.reasoning_effort
    if req.documents:  # (an empty list renders nothing anywhere)
        if not reads("documents"):
            raise unsupported("documents", "this model's chat template renders no documents; put them in a message")
        extra["documents"] = req.documents
    return {**extra, **(req.chat_template_kwargs or {}), "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message}


def chat_prompt(
    processor: MMProcessor, chat: ChatCompletionRequest, media: Sequence[ImageMeta | VideoMeta], options: dict[str, Any]
) -> tuple[Rendered, Prompt]:
    """The request's rendered template and prompt: its messages and tools through the chat template, each image's
    and video's placeholder expanded. The template's own refusal is a 400 naming ``tools`` where it renders the
    messages without them (a template that renders no tools), else ``messages``, as is a prompt whose placeholders
    do not match its media (image-pad tokens typed into the text)."""
    messages, tools = template_messages(chat), template_tools(chat)
    try:
        rendered = processor.render(messages, tools, options)
    except (ValueError, jinja2.TemplateError) as exc:
        refused = exc
    else:
        try:
            return rendered, processor.build(rendered, media)
        except ValueError as exc:
            raise BadRequest(f"The messages cannot be made into a prompt: {exc}", param="messages") from None
    if tools is not None:
        try:  # only on a refusal: was it the tools?
            processor.render(messages, None, options)
        except (ValueError, jinja2.TemplateError):
            pass
        else:
            raise BadRequest(f"This model's chat template refuses the tools: {refused}", param="tools")
    raise BadRequest(f"The messages cannot be made into a prompt: {refused}", param="messages")
