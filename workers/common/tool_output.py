"""One choice's output through its tool-call parser, as the scheduler hands it on: the format is the request's
(``TokenizedRequest.tool_parser``): "hermes" (``<tool_call>{json}</tool_call>``, tools.py), "qwen_xml"
(``<function=...>`` blocks, tool_xml.py) or "gemma4" (``<|tool_call>call:NAME{...}<tool_call|>``, tool_gemma.py)."""

from __future__ import annotations

from ipc.outputs import ToolCallDelta
from workers.common.tool_gemma import GemmaToolCallParser
from workers.common.tool_xml import XmlToolCallParser
from workers.common.tools import TaggedCalls, ToolCallParser

FORMATS = ("hermes", "qwen_xml", "gemma4")


class ToolOutput:
    """Content, tool-call deltas, and the finish reason ("tool_calls" when the answer called a tool and stopped on
    its own). ``types``: each function's parameters' JSON types, which the XML format's values are read by."""

    def __init__(self, fmt: str = "hermes", types: dict[str, dict[str, str]] | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r} (known: {', '.join(FORMATS)})")
        self.parser: TaggedCalls = (
            XmlToolCallParser(types) if fmt == "qwen_xml" else GemmaToolCallParser() if fmt == "gemma4"
            else ToolCallParser()
        )  # fmt: skip

    def step(self, text: str, reason: str | None) -> tuple[str, list[ToolCallDelta], str | None]:
        content, deltas = self.parser.push(text)
        if reason is not None:
            tail, more = self.parser.finish()
            content += tail
            deltas += more
            if reason == "stop" and self.parser.calls:
                reason = "tool_calls"
        return content, deltas, reason
