"""The /v1/messages answer (workers/tokenizer/requests/anthropic.py serves its body as a chat request): Anthropic's
Message, whole, or streamed as its events.

``content`` holds, in order, a ``thinking`` block (with ``--reasoning-parser``; its ``signature`` is empty, nothing is
signed here), a ``text`` block, and a ``tool_use`` block per tool call (``input`` the call's arguments as an object;
``{}`` when the token limit cut them short). ``stop_reason``: ``end_turn`` (an end token), ``stop_sequence`` (the
one that matched in ``stop_sequence``), ``max_tokens`` or ``tool_use``. ``usage`` counts as Anthropic does:
``input_tokens`` are the prompt's uncached tokens, ``cache_read_input_tokens`` the ones the prefix cache held.

A stream sends ``event: <type>`` / ``data: <json>`` pairs: message_start (with the first output), per block
content_block_start, its deltas (thinking_delta, text_delta, input_json_delta) and content_block_stop, then
message_delta (stop_reason, output_tokens) and message_stop.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from ipc.control import RequestFailed
from ipc.requests import RequestAccepted
from server.protocol import encode
from server.responder import Answer, ChoiceState, whole_calls

Block = dict[str, Any]
# Anthropic's error types by HTTP status (others: invalid_request_error below 500, api_error from it).
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesAnswer(Answer):
    ENDS_WITH_DONE = False  # the stream ends with message_stop
    def __init__(self, rid: str, created: int, accepted: RequestAccepted) -> None:
        super().__init__(rid, created, accepted)
        self.started = False
        self.blocks = 0  # content blocks opened so far
        self.open = ""  # the streaming block's kind: "thinking", "text" or "tool_use" ("": none)

    def _usage(self, final: bool) -> dict[str, Any]:
        usage = self.usage()
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
        return {"input_tokens": usage.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": usage.completion_tokens if final else 0}  # fmt: skip

    def _message(self, content: list[Block], c: ChoiceState | None) -> dict[str, Any]:
        """The Message object: whole (``c`` the finished choice) or as message_start opens a stream (None)."""
        stop, sequence = (None, None) if c is None else (self._stop_reason(c), self._stop_sequence(c))
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop, "stop_sequence": sequence, "usage": self._usage(c is not None)}  # fmt: skip

    def _stop_reason(self, c: ChoiceState) -> str:
        return "stop_sequence" if self._stop_sequence(c) else _STOP.get(c.finish_reason or "stop", "end_turn")

    @staticmethod
    def _stop_sequence(c: ChoiceState) -> str | None:
        return c.stop_reason if isinstance(c.stop_reason, str) else None

    def body(self) -> Iterator[bytes]:
        c = self.choices[0]
        content: list[Block] = []
        if thought := "".join(c.reasoning):
            content.append({"type": "thinking", "thinking": thought, "signature": ""})
        text = "".join(c.text)
        calls = whole_calls(c.calls)
        if text or not (calls or thought):
            content.append({"type": "text", "text": text})
        for call in calls:
            content.append({"type": "tool_use", "id": call.id, "name": call.function.name or "",
                            "input": _arguments(call.function.arguments or "")})  # fmt: skip
        yield encode(self._message(content, c))

    # ---- the stream -------------------------------------------------------------------------------------------

    def failure(self, failed: RequestFailed) -> list[bytes]:
        """Anthropic's in-stream error event (what the anthropic SDK raises from), its error type by the status."""
        kind = _ERROR_TYPES.get(failed.status, "api_error" if failed.status >= 500 else "invalid_request_error")
        return [self._event("error", {"error": {"type": kind, "message": failed.message}})]

    @staticmethod
    def _event(kind: str, fields: dict[str, Any]) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + encode({"type": kind, **fields}) + b"\n\n"

    def _start(self, kind: str, block: Block) -> list[bytes]:
        events = self._stop()
        self.open = kind
        self.blocks += 1
        return events + [self._event("content_block_start", {"index": self.blocks - 1, "content_block": block})]

    def _stop(self) -> list[bytes]:
        if not self.open:
            return []
        self.open = ""
        return [self._event("content_block_stop", {"index": self.blocks - 1})]

    def _delta(self, delta: Block) -> bytes:
        return self._event("content_block_delta", {"index": self.blocks - 1, "delta": delta})

    def _chunk(self, c: ChoiceState) -> Iterable[bytes]:
        events: list[bytes] = []
        if not self.started:
            self.started = True
            events.append(self._event("message_start", {"message": self._message([], None)}))
        if thought := "".join(c.reasoning):
            if self.open != "thinking":
                events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": thought}))
        if text := "".join(c.text):
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": text}))
        for piece in c.calls:
            if piece.id:  # a new call
                events += self._start("tool_use", {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
            if piece.arguments and self.open == "tool_use":
                events.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}))
        if self._finishing(c):
            if not self.blocks:  # an empty answer is still one text block
                events += self._start("text", {"type": "text", "text": ""})
            events += self._stop()
            usage = {"output_tokens": c.completion_tokens}
            events.append(self._event("message_delta", {"delta": {"stop_reason": self._stop_reason(c),
                                                                  "stop_sequence": self._stop_sequence(c)}, "usage": usage}))  # fmt: skip
            events.append(self._event("message_stop", {}))
        return events



def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
