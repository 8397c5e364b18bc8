"""SGLang's /generate answer shapes (server/generate_answer.py) fed the outputs a scheduler sends: a stream's events
hold the text so far and the ids new since the one before, and thin out as a choice grows; a whole answer is one
object, or a list for several choices."""

from __future__ import annotations

import json
from typing import Any

from ipc.outputs import RequestOutput
from ipc.requests import RequestAccepted
from server.generate_answer import THIN, GenerateAnswer


def accepted(stream: bool, n: int = 1, prompt_counts: list[int] | None = None) -> RequestAccepted:
    return RequestAccepted("cmpl-1", stream, False, "demo", 10, 0, n, "generate", prompt_counts=prompt_counts or [])


def output(k: int, done: bool = False, index: int = 0) -> RequestOutput:
    return RequestOutput("cmpl-1", f"t{k} ", [k], "length" if done else None, 10, k, index=index, cached_tokens=4)


def events(pieces: Any) -> list[Any]:
    raw = b"".join(pieces).decode()
    return [e.removeprefix("data: ") for e in raw.split("\n\n") if e]


def test_stream_events_thin_out_and_the_last_holds_every_id() -> None:
    answer = GenerateAnswer("cmpl-1", 0, accepted(stream=True))
    tokens = 4 * THIN
    sent: list[dict[str, Any]] = []
    for k in range(1, tokens + 1):
        answer.add(output(k, done=k == tokens))
        for event in events(answer.flush()):
            if event != "[DONE]":
                sent.append(json.loads(event))
    counts = [e["meta_info"]["completion_tokens"] for e in sent]
    assert counts[:THIN] == list(range(1, THIN + 1))  # every token while the answer is short
    gaps = [b - a for a, b in zip(counts, counts[1:], strict=False)]
    # (the last event is the finish, whatever its gap)
    assert all(g >= a // THIN for a, g in zip(counts, gaps[:-1], strict=False)) and max(gaps) > 1
    assert len(sent) < tokens and counts[-1] == tokens
    last = sent[-1]
    assert last["text"] == "".join(f"t{k} " for k in range(1, tokens + 1))
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in sent[:-1])
    # Each event's ids are those new since the one before: joined up, every id once.
    assert [i for e in sent for i in e["output_ids"]] == list(range(1, tokens + 1))
    assert answer.done


def test_whole_answers_are_an_object_or_a_list() -> None:
    one = GenerateAnswer("cmpl-1", 0, accepted(stream=False))
    one.add(output(1))
    one.add(output(2, done=True))
    body = json.loads(b"".join(one.body()))
    assert body == {"text": "t1 t2 ", "output_ids": [1, 2], "meta_info": {
        "id": "cmpl-1", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 10,
        "completion_tokens": 2, "cached_tokens": 4}}
    batch = GenerateAnswer("cmpl-1", 0, accepted(stream=False, n=2, prompt_counts=[3, 7]))
    for index in (1, 0):
        batch.add(output(1, done=True, index=index))
    objects = json.loads(b"".join(batch.body()))
    assert [o["meta_info"]["prompt_tokens"] for o in objects] == [3, 7]  # each prompt's own, not the batch's 10
