"""SGLang's /generate answer shapes (server/generate_answer.py) fed the outputs a scheduler sends: a stream's events
hold the text so far and the ids new since the one before, and thin out as a choice grows; a whole answer is one
object, or a list for several choices."""

from __future__ import annotations

import json
from array import array
from typing import Any

from ipc.logprob_messages import LOGPROB_FLOOR, PromptLogprob, TokenLogprob, TopLogprob
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
    one_of_a_batch = GenerateAnswer("cmpl-1", 0, accepted(stream=False, prompt_counts=[3]))
    one_of_a_batch.add(output(1, done=True))
    assert isinstance(json.loads(b"".join(one_of_a_batch.body())), list)  # SGLang: a batch of one is still a list


def packed_prompt() -> PromptLogprob:
    """Prompt [5, 6, 7] with each position's log probability and its best alternative (k = 1)."""
    i32, f32 = (lambda v: array("i", v).tobytes()), (lambda v: array("f", v).tobytes())
    return PromptLogprob(i32([5, 6, 7]), f32([-1.5, float("-inf")]), i32([1, 3]), 1, i32([6, 9]), f32([-1.5, -0.25]),
                         i32([5, 6, 7, 9]), ["a", "b", "c", "z"])


def sampled(k: int, done: bool = False) -> RequestOutput:
    lp = TokenLogprob(f"t{k}", -0.5 * k, None, [TopLogprob(f"t{k}", -0.5 * k, None)])
    return RequestOutput("cmpl-1", f"t{k}", [k], "length" if done else None, 3, k, [lp], top_ids=[k],
                         prompt_logprobs=packed_prompt() if k == 1 else None)


def test_return_logprob_fills_sglangs_lists() -> None:
    def answer(stream: bool, start: int | None, text: bool) -> GenerateAnswer:
        acc = RequestAccepted("cmpl-1", stream, False, "demo", 3, 0, 1, "generate", logprobs=True,
                              echo_logprobs=None if start is None else 1, logprob_start_len=start, logprob_text=text)
        return GenerateAnswer("cmpl-1", 0, acc)

    whole = answer(False, 0, False)
    whole.add(sampled(1))
    whole.add(sampled(2, done=True))
    meta = json.loads(b"".join(whole.body()))["meta_info"]
    # What lm-eval's sglang-generate sums: position 0 has no logprob; -inf is JSON's stand-in.
    assert meta["input_token_logprobs"] == [[None, 5, None], [-1.5, 6, None], [LOGPROB_FLOOR, 7, None]]
    assert meta["input_top_logprobs"] == [None, [[-1.5, 6, None]], [[-0.25, 9, None]]]
    assert meta["output_token_logprobs"] == [[-0.5, 1, None], [-1.0, 2, None]]
    assert meta["output_top_logprobs"] == [[[-0.5, 1, None]], [[-1.0, 2, None]]]
    assert meta["completion_tokens"] == 2

    texts = answer(False, 2, True)
    texts.add(sampled(1, done=True))
    meta = json.loads(b"".join(texts.body()))["meta_info"]
    assert meta["input_token_logprobs"] == [[LOGPROB_FLOOR, 7, "c"]] and meta["input_top_logprobs"] == [[[-0.25, 9, "z"]]]
    assert meta["output_token_logprobs"] == [[-0.5, 1, "t1"]]

    # The generated tokens' alone (logprob_start_len -1), no alternatives asked (top_logprobs_num 0): no top lists.
    bare = answer(False, None, False)
    bare.add(RequestOutput("cmpl-1", "t1", [1], "length", 3, 1, [TokenLogprob("t1", -0.5, None, [])], top_ids=[]))
    meta = json.loads(b"".join(bare.body()))["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs"] == [[-0.5, 1, None]]
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta

    # A stream: the prompt's in the first event, then each event's own tokens, as its output_ids.
    stream = answer(True, 0, False)
    sent = []
    for k in (1, 2, 3):
        stream.add(sampled(k, done=k == 3))
        sent += [json.loads(e) for e in events(stream.flush()) if e != "[DONE]"]
    assert [len(e["meta_info"].get("input_token_logprobs", [])) for e in sent] == [3, 0, 0]
    assert [e["meta_info"]["output_token_logprobs"] for e in sent] == [[[-0.5 * k, k, None]] for k in (1, 2, 3)]
    assert [e["output_ids"] for e in sent] == [[1], [2], [3]]
