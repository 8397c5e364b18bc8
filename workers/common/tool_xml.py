"""Tool calls in the XML-like format of Qwen3.5 / 3.6 checkpoints' chat templates (the format Qwen3-Coder
introduced), read into OpenAI ``tool_calls`` as the text streams:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text, so the JSON ``arguments`` are rebuilt here, each value typed by its parameter's
JSON-schema type in the request's tools (``arg_types``): a string stays text, numbers, booleans, objects and arrays
are read as JSON (a value that does not parse as its type stays a string, as the model wrote it). The call's id and
name go out once ``<function=NAME>`` is complete, its arguments one parameter at a time as each closes:
``{"city": "Paris"`` then ``, "days": 3`` then ``}``, so the deltas join into the final arguments text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ipc.outputs import ToolCallDelta
from workers.common.tools import TaggedCalls, Tool

_NAME = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_JSON_KINDS = ("integer", "number", "boolean", "object", "array", "null")


def uses_xml_calls(template: str) -> bool:
    """Whether a chat template teaches this format (it shows the model ``<function=`` and ``<parameter=``)."""
    return "<function=" in template and "<parameter=" in template


def arg_types(tools: list[Tool]) -> dict[str, dict[str, str]]:
    """Each function's parameters' JSON-schema types ("" where the schema names none or several but null)."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools:
        props = (tool.function.parameters or {}).get("properties")
        kinds: dict[str, str] = {}
        for key, schema in (props.items() if isinstance(props, dict) else ()):
            kind = schema.get("type") if isinstance(schema, dict) else None
            if isinstance(kind, list):
                kind = next(iter(k for k in kind if k != "null"), "null") if len(kind) <= 2 else ""
            kinds[str(key)] = kind if isinstance(kind, str) else ""
        out[tool.function.name] = kinds
    return out


def typed(value: str, kind: str) -> Any:
    """A parameter's text as its JSON value: ``kind`` from the schema ("" unknown: JSON if it parses)."""
    if kind == "string":
        return value
    if kind in _JSON_KINDS or kind == "":
        try:
            parsed = json.loads(value)
        except ValueError:
            if kind == "boolean" and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            return value
        ok = {
            "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
            "boolean": lambda v: isinstance(v, bool),
            "object": lambda v: isinstance(v, dict),
            "array": lambda v: isinstance(v, list),
            "null": lambda v: v is None,
        }.get(kind, lambda v: True)
        return parsed if ok(parsed) else value
    return value


def _value_text(raw: str) -> str:
    # The template writes each value between newlines: they frame it, they are not part of it.
    if raw.startswith("\n"):
        raw = raw[1:]
    return raw[:-1] if raw.endswith("\n") else raw


class XmlToolCallParser(TaggedCalls):
    """Splits a stream of output text into content and tool-call deltas, for XML-like calls (``TaggedCalls`` reads
    the tags). A ``<tool_call>`` block without a complete ``<function=NAME>`` is given back as content."""

    def __init__(self, types: dict[str, dict[str, str]] | None = None) -> None:
        super().__init__()
        self.types = types or {}

    def _opened(self) -> None:
        self._name: str | None = None  # the current call's, once its header went out
        self._params = 0  # the current call's parameters already sent

    def _partial(self, block: str) -> list[ToolCallDelta]:
        """Deltas for what of the open call's ``block`` is complete: its header, then each closed parameter."""
        out: list[ToolCallDelta] = []
        if self._name is None:
            found = _NAME.search(block)
            if found is None:
                return out
            self._name = found.group(1).strip()
            out.append(ToolCallDelta(self.calls, f"call_{uuid.uuid4().hex[:24]}", self._name))
        kinds = self.types.get(self._name, {})
        params = _PARAM.findall(block)
        for key, raw in params[self._params :]:
            key = key.strip()
            value = json.dumps(typed(_value_text(raw), kinds.get(key, "")), ensure_ascii=False)
            lead = "{" if self._params == 0 else ", "
            out.append(ToolCallDelta(self.calls, arguments=f"{lead}{json.dumps(key, ensure_ascii=False)}: {value}"))
            self._params += 1
        return out

    def _finish_call(self, block: str, closed: bool = True) -> tuple[list[ToolCallDelta], str]:
        out = self._partial(block)
        if self._name is None:
            return [], self._as_written(block, closed)
        out.append(ToolCallDelta(self.calls, arguments="}" if self._params else "{}"))
        self.calls += 1
        self._name = None
        return out, ""
