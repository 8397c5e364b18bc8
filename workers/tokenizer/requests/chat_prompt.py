"""A parsed chat request as the chat template takes it (``ChatTemplate.render``): the messages (image and video
parts as bare placeholders), the tools, and apply_chat_template's options. The generation, the render route and
/tokenize all go through these, so one request renders the same prompt on each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workers.tokenizer.requests.chat import (
    ChatCompletionRequest,
    ContentPart,
    ImagePart,
    TextPart,
    VideoPart,
)
from workers.tokenizer.requests.sampling import unsupported


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
    the checkpoint's chat template reads a variable; ``reasoning_effort`` goes to one that does and is refused
    by one that does not (it would change nothing, silently)."""
    extra: dict[str, Any] = {}
    if req.reasoning_effort is not None:
        if not reads("reasoning_effort"):
            raise unsupported("reasoning_effort", "this model's chat template takes none (where a model can turn "
                              "its thinking off, chat_template_kwargs does, e.g. {\"enable_thinking\": false})")
        extra["reasoning_effort"] = req.reasoning_effort
    return {**extra, **(req.chat_template_kwargs or {}), "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message}
