"""The /v1/responses answer (server/responses_answer.py) fed the outputs a scheduler sends: a whole Response with its
reasoning, message and function_call items, and a stream's typed events in OpenAI's order, each item opened, filled
and closed, ending with response.completed holding the whole Response."""

from __future__ import annotations

import json
from typing import Any

from ipc.logprob_messages import TokenLogprob, TopLogprob
from ipc.outputs import RequestOutput, ToolCallDelta
from ipc.requests import RequestAccepted
from server.responses_answer import ResponsesAnswer

FIELDS = json.dumps({"instructions": "Be brief.", "store": False, "tools": []}).encode()


def answer(stream: bool, logprobs: bool = False) -> ResponsesAnswer:
    accepted = RequestAccepted("resp_1", stream, False, "demo", 10, 0, 1, "responses", logprobs=logprobs,
                               response_fields=FIELDS)  # fmt: skip
    return ResponsesAnswer("resp_1", 1700000000, accepted)


def out(k: int, text: str = "", reasoning: str = "", calls: list[ToolCallDelta] | None = None,
        reason: str | None = None, lps: list[TokenLogprob] | None = None) -> RequestOutput:
    return RequestOutput("resp_1", text, [k], reason, 10, k, lps, cached_tokens=4, tool_calls=calls, reasoning=reasoning,
                         reasoning_tokens=2 if reasoning or k > 2 else None)  # fmt: skip


def events(pieces: Any) -> list[dict[str, Any]]:
    raw = b"".join(pieces).decode()
    found = []
    for block in raw.split("\n\n"):
        if block:
            kind, data = block.split("\n")
            found.append(json.loads(data.removeprefix("data: ")))
            assert kind == "event: " + found[-1]["type"]
    return found


STEPS = [
    {"reasoning": "Adding "}, {"reasoning": "up."}, {"text": "Calling."},
    {"calls": [ToolCallDelta(0, "call_a", "total", "{\"x\": ")]}, {"calls": [ToolCallDelta(0, arguments="1}")]},
    {"calls": [ToolCallDelta(1, "call_b", "total", "{}")], "reason": "tool_calls"},
]


def test_whole_response_holds_reasoning_message_and_calls() -> None:
    whole = answer(stream=False)
    for k, step in enumerate(STEPS, 1):
        whole.add(out(k, **step))
    body = json.loads(b"".join(whole.body()))
    assert (body["id"], body["object"], body["status"], body["model"], body["created_at"]) == (
        "resp_1", "response", "completed", "demo", 1700000000)
    assert body["instructions"] == "Be brief." and body["store"] is False and body["incomplete_details"] is None
    reasoning, message, first, second = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "Adding up."}]
    assert message["type"] == "message" and message["content"][0]["text"] == "Calling."
    assert (first["call_id"], first["name"], first["arguments"]) == ("call_a", "total", "{\"x\": 1}")
    assert (second["call_id"], second["arguments"], second["status"]) == ("call_b", "{}", "completed")
    assert body["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 6,
                             "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 16}  # fmt: skip
    cut = answer(stream=False)
    cut.add(out(1, text="Hel", reason="length"))
    body = json.loads(b"".join(cut.body()))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [o["type"] for o in body["output"]] == ["message"]


def test_stream_events_open_fill_and_close_each_item_in_order() -> None:
    stream = answer(stream=True)
    sent: list[dict[str, Any]] = []
    for k, step in enumerate(STEPS, 1):
        stream.add(out(k, **step))
        sent += events(stream.flush())
    kinds = [e["type"] for e in sent]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    assert sent[0]["response"]["status"] == "in_progress" and sent[0]["response"]["output"] == []
    assert [e["output_index"] for e in sent if e["type"] == "response.output_item.added"] == [0, 1, 2, 3]
    done = {e["type"]: e for e in sent if e["type"].endswith(".done")}
    assert done["response.reasoning_text.done"]["text"] == "Adding up."
    assert done["response.output_text.done"]["text"] == "Calling."
    args = [e["arguments"] for e in sent if e["type"] == "response.function_call_arguments.done"]
    assert args == ["{\"x\": 1}", "{}"]
    final = sent[-1]["response"]
    assert final["status"] == "completed" and [o["type"] for o in final["output"]] == [
        "reasoning", "message", "function_call", "function_call"]
    assert all(o["status"] == "completed" for o in final["output"]) and final["usage"]["output_tokens"] == 6
    assert stream.done


def test_stream_carries_logprobs_and_an_empty_answer_is_one_message() -> None:
    lp = TokenLogprob("Hi", -0.5, [72, 105], [TopLogprob("Hi", -0.5, [72, 105])])
    stream = answer(stream=True, logprobs=True)
    stream.add(out(1, text="Hi", lps=[lp]))
    stream.add(out(2, reason="stop", lps=[TokenLogprob("", -0.1, [], [])]))
    sent = events(stream.flush())
    deltas = [e for e in sent if e["type"] == "response.output_text.delta"]
    assert deltas[0]["logprobs"][0] == {"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                                        "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}]}  # fmt: skip
    part = sent[-1]["response"]["output"][0]["content"][0]
    assert part["text"] == "Hi" and len(part["logprobs"]) == 2
    empty = answer(stream=True)
    empty.add(out(1, reason="stop"))
    kinds = [e["type"] for e in events(empty.flush())]
    assert kinds[2:] == ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                         "response.content_part.done", "response.output_item.done", "response.completed"]  # fmt: skip
