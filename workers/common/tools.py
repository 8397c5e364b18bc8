"""Tool calling: the request's tools, the grammar that enforces ``tool_choice`` "required" or a named
function, and the parser that turns the model's ``<tool_call>{json}</tool_call>`` blocks (the Qwen /
Hermes format) into OpenAI ``tool_calls``, incrementally, as the text streams. Qwen3.5's XML-like calls:
tool_xml.py; Gemma 4's: tool_gemma.py; which parser a choice's output goes through: tool_output.py.

The tools themselves reach the model through the checkpoint's own chat template (processor.render).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import msgspec

from ipc.outputs import ToolCallDelta
from ipc.prompts import StructuredSpec
from workers.common.errors import BadRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The separators of Qwen's tool-call JSON ({"name": "f", "arguments": {...}}), which the grammar keeps too.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class FunctionDef(msgspec.Struct, frozen=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, frozen=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def parse_tools(raw: list[dict[str, Any]]) -> list[Tool]:
    """The request's tools as structs (the raw dicts go to the chat template as the client wrote them, key
    order and all, so the prompt is the one transformers renders from the same request)."""
    try:
        return msgspec.convert(raw, list[Tool])
    except msgspec.ValidationError as exc:
        raise BadRequest(f"Invalid 'tools': {str(exc).replace('`', '')}", param="tools", code="invalid_value") from None


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        raise BadRequest("Tool names must be unique.", param="tools", code="invalid_value")
    if any(not n for n in names):
        raise BadRequest("Every tool needs a function name.", param="tools", code="invalid_value")
    if choice is None or choice in ("none", "auto"):
        return
    if not tools:
        raise BadRequest("'tool_choice' needs 'tools'.", param="tool_choice", code="invalid_value")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        message = f"'tool_choice' names the function `{choice.function.name}`, which is not among the tools."
        raise BadRequest(message, param="tool_choice", code="invalid_value")


def tool_grammar(
    tools: list[Tool], choice: ToolChoice, parallel: bool, tags: tuple[int | None, int | None] = (None, None)
) -> StructuredSpec | None:
    """The grammar of an answer that must call a tool ("required": any of them, one or more when
    ``parallel``; a named choice: that one, once), each call's arguments valid for its schema. ``tags``:
    the token ids of <tool_call> and </tool_call> where the vocabulary has them as single tokens (Qwen's
    added tokens), which the grammar then asks for by id: llguidance keeps added tokens apart from text."""
    if choice in ("none", "auto"):
        return None
    if isinstance(choice, NamedToolChoice):
        tools, parallel = [t for t in tools if t.function.name == choice.function.name], False
    rules = []
    for i, tool in enumerate(tools):
        params = _rebased(tool.function.parameters or {"type": "object"}, "#/properties/arguments")
        schema = {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": _JSON_STYLE,
        }
        rules.append(f"fn{i}: %json {json.dumps(schema)}")
    body = " | ".join(f"fn{i}" for i in range(len(tools)))
    open_, close = (f"<[{tid}]>" if tid is not None else json.dumps(tag) for tid, tag in zip(tags, (OPEN, CLOSE)))
    lines = [
        'start: call ("\\n" call)*' if parallel else "start: call",
        f'call: {open_} "\\n" ({body}) "\\n" {close}',
        *rules,
    ]
    return StructuredSpec("lark", "\n".join(lines))


# Keywords whose values are JSON data, not subschemas: a "$ref" inside them is text, never a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with its local references ("#", "#/$defs/X": pydantic's schemas are full of them) pointing where
    the schema now sits, under ``root`` of the call's schema; else "#/$defs/X" would look for $defs at the call's
    root, and no forced call of such a tool could be compiled."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        else:
            out[key] = value if key in _DATA_KEYWORDS else _rebased(value, root)
    return out


class TaggedCalls:
    """What every format shares: text outside ``<tool_call>`` ... ``</tool_call>`` is content (what may still
    grow into the tag, and the blanks before it, held back), and each block is the format's to read: as it streams
    (``_partial``) and once closed, or cut short by the end of the output (``_finish_call``)."""

    open_tag, close_tag = OPEN, CLOSE  # the format's

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.calls = 0  # finished or started calls
        self._opened()

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if not self.in_call:
                at = self.buffer.find(self.open_tag)
                if at < 0:
                    tag = partial_tail(self.buffer, self.open_tag)
                    head = self.buffer[: len(self.buffer) - tag]
                    keep = tag + len(head) - len(head.rstrip())
                    content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                content.append(self.buffer[:at])
                self.buffer = self.buffer[at + len(self.open_tag) :]
                self.in_call = True
                self._opened()
                continue
            end = self.buffer.find(self.close_tag)
            if end < 0:
                deltas.extend(self._partial(self.buffer))
                break
            block, self.buffer = self.buffer[:end], self.buffer[end + len(self.close_tag) :]
            self.in_call = False
            done, text_back = self._finish_call(block)
            deltas.extend(done)
            content.append(text_back)
        return trim_before_calls("".join(content), bool(deltas) or self.in_call), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output ended: whatever is held back goes out (an unclosed call: what was parsed of it)."""
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        done, text_back = self._finish_call(rest, closed=False)
        return text_back, done

    def _as_written(self, block: str, closed: bool) -> str:
        """A block that is not a call, given back as content with the tags it had."""
        return self.open_tag + block + (self.close_tag if closed else "")

    def _opened(self) -> None:
        """A call's opening tag went by (and at the start): its own state starts afresh."""
        raise NotImplementedError

    def _partial(self, block: str) -> list[ToolCallDelta]:
        """Deltas for what of the open call's text ``block`` can go out already."""
        raise NotImplementedError

    def _finish_call(self, block: str, closed: bool = True) -> tuple[list[ToolCallDelta], str]:
        """Deltas that complete the call in ``block``, or the block given back as content, as it was written
        (``closed``: its closing tag was)."""
        raise NotImplementedError


class ToolCallParser(TaggedCalls):
    """Splits a stream of output text into content and tool-call deltas, for JSON calls.

    Text before a ``<tool_call>`` is content. Inside a call, once its name is known, the first delta
    carries a fresh id and the name, later ones the argument text as it arrives (held back by the
    closing characters that may still turn out to belong to the call's outer object). At
    ``</tool_call>`` the call is parsed for good: its ``arguments`` are the exact JSON text the model
    wrote for them. A block that is not valid JSON is given back as content.
    """

    def _opened(self) -> None:
        self._started = False  # the current call's header went out
        self._sent = 0  # characters of the current call's arguments already sent
        self._args_at = -1  # where the current call's arguments value starts in the buffer

    def _header(self, name: str) -> ToolCallDelta:
        self._started = True
        return ToolCallDelta(self.calls, f"call_{uuid.uuid4().hex[:24]}", name)

    def _partial(self, block: str) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        if not self._started:
            name, args_at = _name_and_args_start(block)
            if name is None:
                return out
            out.append(self._header(name))
            self._args_at = args_at
        if self._args_at < 0:
            return out
        # Everything but a tail of closing braces and blanks, which may be the outer object's.
        raw = block[self._args_at :]
        raw = raw[: len(raw) - partial_tail(raw, CLOSE)]
        safe = len(raw.rstrip("} \n\r\t"))
        if safe > self._sent:
            out.append(ToolCallDelta(self.calls, arguments=raw[self._sent : safe]))
            self._sent = safe
        return out

    def _finish_call(self, block: str, closed: bool = True) -> tuple[list[ToolCallDelta], str]:
        parsed = _parse_call(block)
        if parsed is None:
            if self._started:  # already announced: the call stays, with the text it got
                self.calls += 1
                return [], ""
            return [], self._as_written(block, closed)
        name, arguments = parsed
        out = [] if self._started else [self._header(name)]
        if arguments[: self._sent] == block[self._args_at : self._args_at + self._sent] and len(arguments) > self._sent:
            out.append(ToolCallDelta(self.calls, arguments=arguments[self._sent :]))
        self.calls += 1
        return out, ""


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def trim_before_calls(content: str, calls: bool) -> str:
    # Qwen writes a newline between its text and a call: not part of the content.
    return content.rstrip() if calls else content


def _value_start(block: str, key: str) -> int:
    """Where the JSON value after ``"key":`` starts in ``block`` (-1: not written that far yet)."""
    at = block.find(f'"{key}"')
    colon = block.find(":", at + len(key) + 2) if at >= 0 else -1
    if colon < 0:
        return -1
    start = colon + 1
    while start < len(block) and block[start] in " \t\r\n":
        start += 1
    return start if start < len(block) else -1


def _name_and_args_start(block: str) -> tuple[str | None, int]:
    """The call's name once it is complete, and where its arguments value starts (-1: not yet)."""
    start = _value_start(block, "name")
    if start < 0:
        return None, -1
    try:
        name, _ = json.JSONDecoder().raw_decode(block, start)
    except ValueError:
        return None, -1
    if not isinstance(name, str):
        return None, -1
    return name, _value_start(block, "arguments")


def _parse_call(block: str) -> tuple[str, str] | None:
    """(name, the exact JSON text of its arguments) of a complete call, or None if it is not one."""
    text = block.strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    _, start = _name_and_args_start(text)
    if start >= 0:
        try:
            _, end = json.JSONDecoder().raw_decode(text, start)
            return obj["name"], text[start:end]
        except ValueError:
            pass
    return obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)
