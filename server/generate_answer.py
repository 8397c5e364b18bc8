"""The answers of the native generate endpoints. vLLM's ``POST /inference/v1/generate``
(workers/tokenizer/requests/vllm_generate.py) gets its GenerateResponse, whole: ``{"request_id", "choices": [{"index",
"logprobs", "finish_reason", "token_ids"}], "prompt_logprobs", "kv_transfer_params"}`` (``TokensAnswer``).

SGLang's ``POST /generate`` (workers/tokenizer/requests/sglang_generate.py), in SGLang's shapes:
``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
"cached_tokens"}}``, one object, or a list of them (in order) for a batch of prompts or ``n`` > 1. A stream sends
the same object per event with the text so far (SGLang's default: bench_serving keeps the last event's), the
ids new since the choice's previous event in ``output_ids`` (what AIPerf's SGLang endpoint joins up; resent whole on
every event they would make a long answer's stream quadratic in ids as well as in text), the choice's ``index``
beside them, and ends with ``data: [DONE]``.

With ``return_logprob`` meta_info also holds SGLang's log-prob lists (server/generate_logprobs.py): whole in a whole
answer; in a stream, the prompt's in a choice's first event and, as with ``output_ids``, the generated tokens' new
since the choice's previous event.

Since every event resends the text so far, a choice's events thin out as it grows: one once its new tokens reach
1/``THIN`` of those already sent (every token for the first ``THIN``). A 128K-token answer of 4 bytes a token then
takes ~2,000 events instead of 128K, and the event loop encodes 0.14 GB for it instead of 34 GB (docs/limits.md).
bench_serving, which spreads an event's interval over its new tokens, reads the same inter-token latencies.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ipc.outputs import RequestOutput
from ipc.requests import RequestAccepted
from server.completion_answer import PromptRows
from server.generate_logprobs import ChoiceLogprobs, meta_pieces
from server.protocol import encode, sse_event
from server.responder import Answer, ChoiceState

THIN = 256


class GenerateAnswer(Answer):
    def __init__(self, rid: str, created: int, accepted: RequestAccepted) -> None:
        super().__init__(rid, created, accepted)
        # Everything of each choice so far (the base class keeps only what came since the last flush).
        self.texts: list[list[str]] = [[] for _ in self.choices]
        self.ids: list[list[int]] = [[] for _ in self.choices]
        self.counts: list[tuple[int, int]] = [(0, 0) for _ in self.choices]  # (prompt, cached) tokens per choice
        self.sent = [0] * len(self.choices)  # a stream: each choice's tokens as of its last event
        self.ids_sent = [0] * len(self.choices)  # a stream: each choice's output ids already in an event
        # return_logprob: each choice's log probabilities not yet written, and whether its prompt's were.
        self.logprobs = [ChoiceLogprobs() for _ in self.choices]
        self.inputs_sent = [False] * len(self.choices)
        self.top_k = 0

    def add(self, out: RequestOutput) -> None:
        super().add(out)
        if out.text:
            self.texts[out.index].append(out.text)
        self.ids[out.index].extend(out.token_ids)
        self.counts[out.index] = (out.prompt_tokens, out.cached_tokens)
        lp = self.logprobs[out.index]
        if out.prompt_logprobs is not None:
            lp.prompt = PromptRows(out.prompt_logprobs)
        lp.add(out.token_ids, out.logprobs, out.top_ids)
        if out.logprobs:  # top_logprobs_num, when the prompt's are not asked for (echo_logprobs): as every token has
            self.top_k = len(out.logprobs[0].top_logprobs)

    def _pieces(self, c: ChoiceState, finished: bool, ids: list[int], head: dict[str, Any]) -> Iterator[bytes]:
        """One answer object (``head``'s keys first, meta_info last) with ``ids`` as its output_ids, and the log
        probabilities when asked for."""
        obj = {**head, **self._object(c, finished, ids)}
        if not self.accepted.logprobs:
            yield encode(obj)
            return
        lp = self.logprobs[c.index].take()
        k = self.accepted.echo_logprobs if self.accepted.echo_logprobs is not None else self.top_k
        with_input = not self.inputs_sent[c.index]
        self.inputs_sent[c.index] = True
        yield encode(obj)[:-2]  # into meta_info, the object's last key
        yield from meta_pieces(lp, self.accepted.logprob_start_len, k, self.accepted.logprob_text, with_input)
        yield b"}}"

    def _object(self, c: ChoiceState, finished: bool, ids: list[int]) -> dict[str, Any]:
        prompt, cached = self.counts[c.index]
        if self.accepted.prompt_counts:  # a batch: the outputs carry the batch's total
            prompt = self.accepted.prompt_counts[c.index]
        reason: dict[str, Any] | None = None
        if finished and c.finish_reason is not None:
            reason = {"type": c.finish_reason}
            if c.finish_reason == "length":
                reason["length"] = c.completion_tokens
            elif c.finish_reason == "stop":  # SGLang's: the stop string or token that matched (an end token's id)
                reason["matched"] = c.stop_reason if c.stop_reason is not None or not ids else ids[-1]
        text = "".join(self.texts[c.index])
        self.texts[c.index] = [text]
        meta = {"id": self.rid, "finish_reason": reason, "prompt_tokens": prompt,
                "completion_tokens": c.completion_tokens, "cached_tokens": cached}  # fmt: skip
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _due(self, c: ChoiceState) -> bool:
        fresh = c.completion_tokens - self.sent[c.index]
        return self._finishing(c) or (fresh > 0 and fresh >= self.sent[c.index] // THIN)

    def _chunk(self, c: ChoiceState) -> Iterable[bytes]:
        self.sent[c.index] = c.completion_tokens
        ids = self.ids[c.index]
        new_ids, self.ids_sent[c.index] = ids[self.ids_sent[c.index] :], len(ids)
        return [sse_event(b"".join(self._pieces(c, self._finishing(c), new_ids, {"index": c.index})))]

    def body(self) -> Iterator[bytes]:
        # SGLang answers a batch of prompts (even of one) or n > 1 with a list, one prompt with an object.
        listed = len(self.choices) > 1 or bool(self.accepted.prompt_counts)
        yield b"[" if listed else b""
        for c in self.choices:
            yield b"," if c.index else b""
            yield from self._pieces(c, True, self.ids[c.index], {})
        yield b"]" if listed else b""


class TokensAnswer(Answer):
    """vLLM's GenerateResponse: each choice's token ids and finish reason (never streamed: the body refuses it)."""

    def __init__(self, rid: str, created: int, accepted: RequestAccepted) -> None:
        super().__init__(rid, created, accepted)
        self.ids: list[list[int]] = [[] for _ in self.choices]

    def add(self, out: RequestOutput) -> None:
        super().add(out)
        self.ids[out.index].extend(out.token_ids)

    def body(self) -> Iterator[bytes]:
        choices = [{"index": c.index, "logprobs": None, "finish_reason": c.finish_reason, "token_ids": self.ids[c.index]}
                   for c in self.choices]  # fmt: skip
        yield encode({"request_id": self.rid, "choices": choices, "prompt_logprobs": None, "kv_transfer_params": None})
