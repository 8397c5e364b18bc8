"""The chat template side of a prompt: rendering a conversation with the checkpoint's template, and tokenizing
the result so that only the template can insert control tokens.

Client text (message text, tool results, earlier tool calls, tool definitions) goes through the template as an
indexed sentinel and comes back as pieces of its own (``Rendered``), which ``ChatTemplate.token_ids`` tokenizes
with special-token strings split into ordinary tokens: a user typing ``<|im_end|>`` cannot end its turn. The
multimodal processor (processor.py) owns one and expands the image and video placeholders of what it renders.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from workers.common.tool_gemma import uses_gemma_calls
from workers.common.tool_xml import uses_xml_calls

# Marks where the client's text goes in the rendered template. The client's text itself never passes through
# the template (only its index does), so nothing a client sends can forge or break a marker.
_SENTINEL = "\x00glimpse\x00"


@dataclass(frozen=True)
class Rendered:
    """A chat rendered by the template, as (text, came from the client) pieces in order."""

    pieces: list[tuple[str, bool]]

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.pieces)


def _called(call: dict[str, Any], text: Any, arguments: Any = None) -> dict[str, Any]:
    """An earlier assistant turn's tool call with its client text (name, string arguments) through ``text``;
    ``arguments``: what to hand the template instead of the client's arguments string, when given."""
    fn = dict(call.get("function") or {})
    if "name" in fn:
        fn["name"] = text(fn["name"])
    if arguments is not None:
        fn["arguments"] = arguments
    elif isinstance(fn.get("arguments"), str):
        fn["arguments"] = text(fn["arguments"])
    return {**call, "function": fn}


def _json_object(text: Any) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ChatTemplate:
    """A checkpoint's chat template and tokenizer, with the strings its tokenizer would make control tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # Strings the tokenizer would turn into control tokens (special and added tokens alike).
        self._special_strings = tuple(str(t) for t in self.tokenizer.get_added_vocab())
        # How the model writes tool calls, as its template teaches it: Qwen3.5's <function=...> blocks, Gemma 4's
        # <|tool_call>call:...{...}, else JSON.
        template = getattr(tokenizer, "chat_template", None)
        texts = list(template.values()) if isinstance(template, dict) else [template or ""]
        self._source = "\n".join(str(t) for t in texts)
        self.tool_format = (
            "qwen_xml" if any(uses_xml_calls(str(t)) for t in texts)
            else "gemma4" if any(uses_gemma_calls(str(t)) for t in texts) else "hermes"
        )  # fmt: skip

    @cached_property
    def added_specials(self) -> tuple[list[int], list[int]]:
        """`added_specials` of this tokenizer, found once (a per-request constant)."""
        return added_specials(self.tokenizer)

    def reads(self, variable: str) -> bool:
        """Whether the template's source names ``variable`` (a request option it would act on)."""
        return re.search(rf"\b{re.escape(variable)}\b", self._source) is not None

    def render(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        options: dict[str, Any] | None = None,
    ) -> Rendered:
        """Apply the chat template; image parts become the model's image placeholder.

        Text that came from the client is put through the template as a sentinel and returned apart from
        the template's own text, so ``token_ids`` can tokenize it with special-token strings kept as text:
        only the chat template inserts control tokens (a user typing ``<|im_end|>`` cannot end its turn).
        A template that transforms content (strips it, branches on it) sees the sentinel, not the text; so
        the real text is rendered too, and where the two disagree the real rendering is used as one template
        piece -- unless some client text holds a special-token string, where keeping it text comes first.

        Tool results, the names and arguments of earlier tool calls and the tool definitions are client text
        too. Templates write a tool as ``tool | tojson``: it goes in as a one-key object whose key is a
        sentinel, and the JSON tojson makes of that is turned back into the sentinel (whose text is the
        tool's JSON, as tojson would have written it). ``options``: more apply_chat_template arguments (default: a
        generation prompt). Raises ValueError when ``tools`` are given and the template has no place for them, or
        reads into them while client text holds a special-token string."""
        texts: list[str] = []

        def hold(text: Any) -> str:
            texts.append(str(text))
            return f"{_SENTINEL}{len(texts) - 1}{_SENTINEL}"

        held = [self._plain(message, hold) for message in messages]
        refs = [hold(json.dumps(tool, ensure_ascii=False)) for tool in tools] if tools else []
        plain = [self._plain(message, str) for message in messages]
        real = self._apply_template(plain, tools, options)
        if tools and real == self._apply_template(plain, None, options):
            raise ValueError("the model's chat template does not render tools")
        if not any(self._has_special(t) for t in texts):
            # Nothing to keep apart: the template's own rendering, tokenized in one pass (token_ids), is
            # exactly what transformers tokenizes; the sentinel rendering would buy nothing.
            return Rendered([(real, False)])
        text = self._apply_template(held, [{ref: 0} for ref in refs] or None, options)
        written = [json.dumps({ref: 0}, ensure_ascii=False) for ref in refs]
        tools_held = all(w in text for w in written)  # False: the template reads into a tool
        for ref, w in zip(refs, written, strict=True):
            text = text.replace(w, ref)
        pieces: list[tuple[str, bool]] = []
        for i, chunk in enumerate(text.split(_SENTINEL)):
            # Odd chunks are sentinel indices: the client's text; even chunks are the template's.
            if i % 2:
                pieces.append((texts[int(chunk)], True))
            elif chunk:
                pieces.append((chunk, False))
        rendered = Rendered(pieces)
        if real != rendered.text and not tools_held:
            raise ValueError("client text holds a control-token string and the template reads into the tools")
        return rendered

    def _plain(self, message: dict[str, Any], text: Any) -> dict[str, Any]:
        content = message.get("content")
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for part in content:
                if part.get("type") in ("image", "image_url", "input_image"):
                    parts.append({"type": "image"})
                elif part.get("type") in ("video", "video_url"):
                    parts.append({"type": "video"})
                else:
                    parts.append({"type": "text", "text": text(part.get("text", ""))})
            return {**message, "content": parts}
        out = {**message, "content": text(content)} if isinstance(content, str) else dict(message)
        if message.get("tool_calls"):
            out["tool_calls"] = [_called(call, text, self._mapping(call, text)) for call in message["tool_calls"]]
        return out

    def _mapping(self, call: dict[str, Any], text: Any) -> dict[str, Any] | None:
        """An XML-call template walks a call's arguments as a mapping (``arguments|items``), where an OpenAI
        client sends a JSON string: the object it holds, its keys and string values client text. A control-token
        string deeper in (a nested value, which the template writes as JSON) cannot be kept text: refused."""
        parsed = _json_object((call.get("function") or {}).get("arguments")) if self.tool_format == "qwen_xml" else None
        if parsed is None:
            return None
        nested = [json.dumps(v, ensure_ascii=False) for v in parsed.values() if not isinstance(v, str)]
        if any(self._has_special(t) for t in nested):
            raise ValueError("a tool call's argument holds a control-token string inside a nested value")
        return {text(k): text(v) if isinstance(v, str) else v for k, v in parsed.items()}

    def _apply_template(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None, options: dict[str, Any] | None = None
    ) -> str:
        extra: dict[str, Any] = {"add_generation_prompt": True, **(options or {})}
        if tools:
            extra["tools"] = tools
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, **extra))

    def _has_special(self, text: str) -> bool:
        return any(token in text for token in self._special_strings)

    def token_ids(self, rendered: Rendered | str) -> list[int]:
        """Tokenize a rendered prompt: the template's text with its special tokens, the client's text with
        special-token strings split into ordinary tokens. The pieces meet at pretokenizer boundaries (a
        newline or a special token on the template's side), so this equals tokenizing the joined string
        whenever the client's text holds no special-token string."""
        if isinstance(rendered, str):
            rendered = Rendered([(rendered, False)])
        if not any(client and self._has_special(text) for text, client in rendered.pieces):
            # Nothing to keep apart: one pass over the whole text, as transformers tokenizes it (pieces
            # do not always meet at pretokenizer boundaries: "." + "\n\n" is one pretoken, "}" + "}" too).
            return list(self.tokenizer(rendered.text, add_special_tokens=False)["input_ids"])
        ids: list[int] = []
        for text, client in rendered.pieces:
            out = self.tokenizer(text, add_special_tokens=False, split_special_tokens=client)["input_ids"]
            ids.extend(out)
        return ids


def added_specials(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids ``tokenizer`` puts before and after a text with ``add_special_tokens`` (found around one letter)."""
    bare = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
    return ([], []) if at is None else (full[:at], full[at + len(bare) :])
