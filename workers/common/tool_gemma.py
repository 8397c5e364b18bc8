"""Tool calls in Gemma 4's own syntax, read into OpenAI ``tool_calls`` as the text streams:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:{temp:<|"|>C<|"|>}}<tool_call|>

The tags and the string quote ``<|"|>`` are special tokens of Gemma 4's vocabulary: the scheduler's detokenizer keeps
these three in the text of a request that may call tools (``keep_ids``). Keys are bare words, strings are quoted
with ``<|"|>`` (a JSON-quoted string is taken too), numbers, ``true``, ``false`` and ``null`` are bare, objects and
arrays nest with braces and brackets. The call's id and name go out once ``call:NAME{`` is written; its arguments,
rebuilt as JSON, when the call closes. A block that does not parse is given back as content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ipc.outputs import ToolCallDelta
from workers.common.tools import TaggedCalls

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_HEAD = re.compile(r"\s*call:([^{\s]+)\s*\{")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?$")


def uses_gemma_calls(template: str) -> bool:
    """Whether a chat template writes Gemma 4's tool-call tags."""
    return OPEN in template and CLOSE in template


def keep_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the special tokens this format needs in the text (empty where the vocabulary lacks one)."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    ids = [vocab.get(token) for token in (OPEN, CLOSE, QUOTE)]
    return frozenset() if None in ids else frozenset(i for i in ids if i is not None)


class _Reader:
    """A recursive-descent reader of one call's ``{...}`` body (ValueError where it is not one)."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def blank(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in " \t\r\n":
            self.at += 1

    def take(self, token: str) -> bool:
        self.blank()
        if self.text.startswith(token, self.at):
            self.at += len(token)
            return True
        return False

    def value(self, depth: int = 0) -> Any:
        if depth > 64:
            raise ValueError("nested too deep")
        self.blank()
        if self.take("{"):
            return dict(self.items("}", lambda: self.pair(depth)))
        if self.take("["):
            return self.items("]", lambda: self.value(depth + 1))
        if self.take(QUOTE):
            end = self.text.find(QUOTE, self.at)
            if end < 0:
                raise ValueError("unclosed string")
            self.at, out = end + len(QUOTE), self.text[self.at : end]
            return out
        if self.text.startswith('"', self.at):
            out, self.at = json.JSONDecoder().raw_decode(self.text, self.at)
            return out
        word = self.word(",}]")
        if word in ("true", "false", "null"):
            return json.loads(word)
        if _NUMBER.match(word):
            return json.loads(word)
        return word  # a bare word: the model's text, as written

    def pair(self, depth: int) -> tuple[str, Any]:
        self.blank()
        key = self.value(depth + 1) if self.text.startswith((QUOTE, '"'), self.at) else self.word(":")
        if not self.take(":"):
            raise ValueError("a key without a value")
        return str(key), self.value(depth + 1)

    def items(self, close: str, item: Any) -> list[Any]:
        out: list[Any] = []
        if self.take(close):
            return out
        while True:
            out.append(item())
            if self.take(close):
                return out
            if not self.take(","):
                raise ValueError(f"expected ',' or '{close}'")

    def word(self, stops: str) -> str:
        self.blank()
        start = self.at
        while self.at < len(self.text) and self.text[self.at] not in stops:
            self.at += 1
        word = self.text[start : self.at].strip()
        if not word:
            raise ValueError("an empty value")
        return word


def parse_arguments(body: str) -> dict[str, Any]:
    """A call's ``{...}`` (from its brace on) as a dict; ValueError where it is not exactly one object."""
    reader = _Reader(body)
    value = reader.value()
    reader.blank()
    if not isinstance(value, dict) or reader.at != len(body):
        raise ValueError("not one object")
    return value


class GemmaToolCallParser(TaggedCalls):
    """Splits a stream of output text into content and tool-call deltas, for Gemma 4's calls."""

    open_tag, close_tag = OPEN, CLOSE

    def _opened(self) -> None:
        self._name: str | None = None  # the current call's, once its header went out

    def _partial(self, block: str) -> list[ToolCallDelta]:
        if self._name is not None:
            return []
        head = _HEAD.match(block)
        if head is None:
            return []
        self._name = head.group(1)
        return [ToolCallDelta(self.calls, f"call_{uuid.uuid4().hex[:24]}", self._name)]

    def _finish_call(self, block: str, closed: bool = True) -> tuple[list[ToolCallDelta], str]:
        head = _HEAD.match(block)
        try:
            arguments = parse_arguments(block[head.end() - 1 :]) if head is not None else None
        except ValueError:
            arguments = None
        announced, self._name = self._name is not None, None
        index = self.calls
        if arguments is None or head is None:
            if announced:  # its header went out in an earlier step: the call stays, with no arguments
                self.calls += 1
                return [ToolCallDelta(index, arguments="{}")], ""
            return [], self._as_written(block, closed)
        out = [] if announced else [ToolCallDelta(index, f"call_{uuid.uuid4().hex[:24]}", head.group(1))]
        out.append(ToolCallDelta(index, arguments=json.dumps(arguments, ensure_ascii=False)))
        self.calls += 1
        return out, ""
