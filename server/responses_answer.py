"""The /v1/responses answer (workers/tokenizer/requests/responses.py serves its body as a chat request): OpenAI's
Response object, whole, or streamed as its typed events.

A Response's ``output`` holds, in order, a ``reasoning`` item (with ``--reasoning-parser``: the reasoning text as a
``reasoning_text`` part), a ``message`` item (one ``output_text`` part; its ``logprobs`` when asked for) unless the
answer is only tool calls or only reasoning, and a ``function_call`` item per tool call. ``status`` is "completed", or "incomplete"
with ``incomplete_details.reason`` "max_output_tokens" when the token limit cut it; ``usage`` counts input, cached,
output and reasoning tokens. The request's settings are repeated as the tokenizer stated them
(``RequestAccepted.response_fields``).

A stream sends ``event: <type>`` / ``data: <json>`` pairs, each with a ``sequence_number``: response.created and
response.in_progress with the first output, then per item output_item.added, its part's content_part.added, the
deltas (output_text.delta, reasoning_text.delta, function_call_arguments.delta), their .done events and
output_item.done, and at the end response.completed holding the whole Response (also when it is incomplete, as
vLLM ends it: benchmark clients read usage from that event). No ``[DONE]`` follows, as OpenAI sends none.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from ipc.control import RequestFailed
from ipc.logprob_messages import TokenLogprob
from ipc.requests import RequestAccepted
from server.protocol import encode
from server.responder import Answer, ChoiceState, whole_calls

Item = dict[str, Any]


class ResponsesAnswer(Answer):
    ENDS_WITH_DONE = False  # OpenAI ends a Responses stream with response.completed
    def __init__(self, rid: str, created: int, accepted: RequestAccepted) -> None:
        super().__init__(rid, created, accepted)
        self.sequence = 0
        self.items: list[Item] = []  # output items, the last one open while it streams
        self.open = ""  # the streaming item's kind: "reasoning", "message" or "function_call" ("": none)
        self.calls = 0

    # ---- the Response object ----------------------------------------------------------------------------------

    def _response(self, status: str, output: list[Item], error: Item | None = None) -> bytes:
        c = self.choices[0]
        incomplete = status == "incomplete"
        head: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "model": self.model,
            "output": output, "usage": self._usage() if c.finish_reason is not None else None,
        }  # fmt: skip
        fields = self.accepted.response_fields or b"{}"
        body = encode(head)
        return body[:-1] + (b"," + fields[1:] if len(fields) > 2 else b"}")

    def _usage(self) -> dict[str, Any]:
        usage = self.usage()
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
        details = usage.completion_tokens_details
        return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": details.reasoning_tokens if details else 0},
                "total_tokens": usage.total_tokens}  # fmt: skip

    def _status(self) -> str:
        return "incomplete" if self.choices[0].finish_reason == "length" else "completed"

    def _logprobs(self, entries: list[TokenLogprob]) -> list[TokenLogprob] | None:
        return entries if self.accepted.logprobs else None

    def body(self) -> Iterator[bytes]:
        c = self.choices[0]
        output: list[Item] = []
        reasoning = "".join(c.reasoning)
        if reasoning:
            output.append(_reasoning_item(self.rid, reasoning, "completed"))
        text = "".join(c.text)
        calls = whole_calls(c.calls)
        if text or not (calls or reasoning):
            output.append(_message_item(self.rid, text, self._logprobs(c.logprobs), "completed"))
        for i, call in enumerate(calls):
            output.append(_call_item(self.rid, i, call.id, call.function.name or "", call.function.arguments or "",
                                     "completed"))  # fmt: skip
        yield self._response(self._status(), output)

    # ---- the stream -------------------------------------------------------------------------------------------

    def failure(self, failed: RequestFailed) -> list[bytes]:
        """OpenAI's end of a Responses stream that failed: the open item closed, then ``response.failed`` with the
        Response so far, its ``status`` "failed" and its ``error`` (the openai SDK's stream stops on it)."""
        events = self._begun() + self._close()
        error = {"code": failed.code or failed.type, "message": failed.message}
        response = self._response("failed", list(self.items), error)
        return [*events, self._event("response.failed", {"response": msgspec.Raw(response)})]

    def _begun(self) -> list[bytes]:
        """response.created and response.in_progress, which open a stream (none once they went out)."""
        if self.sequence:
            return []
        created = self._response("in_progress", [])
        return [self._event(kind, {"response": msgspec.Raw(created)})
                for kind in ("response.created", "response.in_progress")]  # fmt: skip

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        self.sequence += 1
        data = encode({"type": kind, "sequence_number": self.sequence - 1, **fields})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _opened(self, kind: str, item: Item, part: Item | None) -> list[bytes]:
        self.items.append(item)
        self.open = kind
        events = [self._event("response.output_item.added", {"output_index": len(self.items) - 1, "item": item})]
        if part is not None:
            events.append(self._event("response.content_part.added", self._where() | {"part": part}))
        return events

    def _where(self) -> dict[str, Any]:
        index = len(self.items) - 1
        return {"item_id": self.items[index]["id"], "output_index": index, "content_index": 0}

    def _close(self) -> list[bytes]:
        """The open item's closing events (none open: none)."""
        if not self.open:
            return []
        item, where, kind = self.items[-1], self._where(), self.open
        self.open = ""
        item["status"] = "completed"
        events = []
        if kind == "function_call":
            done = {"item_id": item["id"], "output_index": where["output_index"], "name": item["name"],
                    "arguments": item["arguments"]}  # fmt: skip
            events.append(self._event("response.function_call_arguments.done", done))
        else:
            part = item["content"][0]
            texts = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
            extra = {"logprobs": part["logprobs"]} if kind == "message" else {}
            events.append(self._event(texts, where | {"text": part["text"]} | extra))
            events.append(self._event("response.content_part.done", where | {"part": part}))
        events.append(self._event("response.output_item.done", {"output_index": where["output_index"], "item": item}))
        return events

    def _chunk(self, c: ChoiceState) -> Iterable[bytes]:
        events = self._begun()
        if reasoning := "".join(c.reasoning):
            if self.open != "reasoning":
                events += self._close()
                item = _reasoning_item(self.rid, "", "in_progress")
                events += self._opened("reasoning", item, item["content"][0])
            self.items[-1]["content"][0]["text"] += reasoning
            events.append(self._event("response.reasoning_text.delta", self._where() | {"delta": reasoning}))
        text = "".join(c.text)
        # (a token that adds no text yet still gets its delta with its logprobs; not beside reasoning or calls)
        if text or (c.logprobs and not (c.calls or reasoning)):
            if self.open != "message":
                events += self._close()
                item = _message_item(self.rid, "", [] if self.accepted.logprobs else None, "in_progress")
                events += self._opened("message", item, item["content"][0])
            part = self.items[-1]["content"][0]
            part["text"] += text
            lps = self._logprobs(list(c.logprobs))
            if lps is not None:
                part["logprobs"] += lps
            events.append(self._event("response.output_text.delta", self._where() | {"delta": text, "logprobs": lps or []}))
        for delta in c.calls:
            if delta.id:  # a new call
                events += self._close()
                events += self._opened("function_call", _call_item(self.rid, self.calls, delta.id, delta.name, "",
                                                                   "in_progress"), None)  # fmt: skip
                self.calls += 1
            if delta.arguments and self.open == "function_call":
                self.items[-1]["arguments"] += delta.arguments
                where = self._where()
                events.append(self._event("response.function_call_arguments.delta",
                                          {"item_id": where["item_id"], "output_index": where["output_index"],
                                           "delta": delta.arguments}))  # fmt: skip
        if self._finishing(c):
            events += self._close()
            if not self.items:  # an empty answer is still one message
                item = _message_item(self.rid, "", [] if self.accepted.logprobs else None, "in_progress")
                events += self._opened("message", item, item["content"][0]) + self._close()
            events.append(self._event("response.completed", {"response": msgspec.Raw(self._response(self._status(), self.items))}))
        return events



def _reasoning_item(rid: str, text: str, status: str) -> Item:
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _message_item(rid: str, text: str, logprobs: list[TokenLogprob] | None, status: str) -> Item:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant", "content": [part]}


def _call_item(rid: str, index: int, call_id: str, name: str, arguments: str, status: str) -> Item:
    return {"type": "function_call", "id": f"fc_{rid}_{index}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip
