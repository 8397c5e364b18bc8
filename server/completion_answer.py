"""The /v1/completions answer: OpenAI's legacy shapes (``text``, ``logprobs`` as parallel lists) and vLLM's
``prompt_logprobs``, rendered in slices.

A prompt's log probabilities arrive packed (``PromptLogprob``: int32 ids, float32 values, the ids' texts
once). Written whole they can reach tens of MB of JSON, so they are never built as one document: every
list is encoded a slice of positions at a time and handed out as pieces, which server/app.py sends as it
takes them, giving the event loop back between sends (issue 40). The answer's JSON is the same bytes a
single ``msgspec`` encode of the whole document gives; only its making is spread out.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec

from ipc.logprob_messages import LOGPROB_FLOOR, PromptLogprob, TokenLogprob
from ipc.requests import RequestAccepted
from server.protocol import Usage, encode, sse_event
from server.responder import Answer, ChoiceState

_SLICE_ENTRIES = 2048  # log-prob entries encoded at once: a few ms of work, a few tens of KB of JSON


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions shape: parallel lists, top alternatives as {token: logprob}."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class RankedLogprob(msgspec.Struct):
    """vLLM's ``prompt_logprobs`` entry: a token's logprob, its rank (1: the most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str


def with_chosen(top: dict[str, float], token: str, logprob: float) -> dict[str, float]:
    """OpenAI's legacy completions always list the chosen token among a position's alternatives, so there may be
    logprobs + 1 of them."""
    top.setdefault(token, logprob)
    return top


def finite(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


class PromptRows:
    """A packed prompt, unpacked into flat arrays (still 4-8 bytes an entry) with its id -> text table."""

    def __init__(self, packed: PromptLogprob) -> None:
        self.ids, self.logprobs, self.ranks = array("i"), array("f"), array("i")
        self.top_ids, self.top_logprobs = array("i"), array("f")
        for arr, raw in ((self.ids, packed.token_ids), (self.logprobs, packed.logprobs), (self.ranks, packed.ranks),
                         (self.top_ids, packed.top_ids), (self.top_logprobs, packed.top_logprobs)):
            arr.frombytes(raw)
        self.k = packed.k
        self.text = dict(zip(array("i", packed.vocab_ids), packed.texts, strict=True))
        # Positions that have their numbers (a short count would be a scheduler bug, logged there).
        self.size = min(len(self.ids), len(self.logprobs) + 1)

    def token(self, i: int) -> str:
        return self.text[self.ids[i]]

    def top_ids_at(self, i: int, k: int) -> list[tuple[int, float]]:
        """Position i's (i >= 1) k best alternatives: (token id, logprob), best first."""
        at = (i - 1) * self.k
        return list(zip(self.top_ids[at : at + k], map(finite, self.top_logprobs[at : at + k]), strict=True))

    def top(self, i: int, k: int) -> list[tuple[str, float]]:
        """The same by token text."""
        return [(self.text[t], v) for t, v in self.top_ids_at(i, k)]


def json_list(size: int, items: Callable[[int, int], list[Any]], step: int) -> Iterator[bytes]:
    """A JSON array of ``size`` items, ``items(a, b)`` giving items a..b-1, encoded ``step`` at a time."""
    yield b"["
    for a in range(0, size, step):
        if a:
            yield b","
        yield encode(items(a, min(size, a + step)))[1:-1]
    yield b"]"


def key(name: str) -> bytes:
    return b'"' + name.encode() + b'":'


class _EchoLogprobs:
    """``choices[].logprobs`` of one output: the echoed prompt's positions (if any) first, then the tokens it
    generated, as the four parallel lists of the legacy shape."""

    def __init__(self, prompt: PromptRows | None, k: int, entries: list[TokenLogprob], offset: int) -> None:
        self.prompt, self.k, self.entries, self.offset = prompt, k, entries, offset
        self.lead = prompt.size if prompt is not None else 0
        self.size = self.lead + len(entries)
        self.step = max(1, _SLICE_ENTRIES // (k + 2))

    def _gen(self, a: int, b: int) -> list[TokenLogprob]:
        return self.entries[max(0, a - self.lead) : max(0, b - self.lead)]

    def tokens(self, a: int, b: int) -> list[str]:
        p = self.prompt
        head = [p.token(i) for i in range(a, min(b, self.lead))] if p is not None else []
        return head + [e.token for e in self._gen(a, b)]

    def values(self, a: int, b: int) -> list[float | None]:
        p = self.prompt
        lead = range(a, min(b, self.lead))
        head = [None if i == 0 else finite(p.logprobs[i - 1]) for i in lead] if p is not None else []
        return head + [e.logprob for e in self._gen(a, b)]

    def tops(self, a: int, b: int) -> list[dict[str, float] | None]:
        p, out = self.prompt, list[dict[str, float] | None]()
        for i in range(a, min(b, self.lead)):
            if p is None or i == 0:
                out.append(None)
            else:
                out.append(with_chosen(dict(p.top(i, self.k)), p.token(i), finite(p.logprobs[i - 1])))
        return out + [with_chosen({t.token: t.logprob for t in e.top_logprobs}, e.token, e.logprob) for e in self._gen(a, b)]

    def offsets(self) -> Iterator[bytes]:
        # Running sums: the prompt's from 0, the generated tokens' from where the answer's text had got to.
        p, values, at = self.prompt, [], 0
        for i in range(self.lead):
            values.append(at)
            at += len(p.token(i)) if p is not None else 0
        at = self.offset
        for e in self.entries:
            values.append(at)
            at += len(e.token)
        return json_list(len(values), lambda a, b: values[a:b], _SLICE_ENTRIES)

    def pieces(self) -> Iterator[bytes]:
        yield b"{" + key("tokens")
        yield from json_list(self.size, self.tokens, self.step)
        yield b"," + key("token_logprobs")
        yield from json_list(self.size, self.values, self.step)
        yield b"," + key("top_logprobs")
        yield from json_list(self.size, self.tops, self.step)
        yield b"," + key("text_offset")
        yield from self.offsets()
        yield b"}"


def _ranked(prompt: PromptRows, k: int) -> Iterator[bytes]:
    """vLLM's prompt_logprobs: None for the first token, then per token the token itself and the k best there."""

    def rows(a: int, b: int) -> list[dict[str, RankedLogprob] | None]:
        out: list[dict[str, RankedLogprob] | None] = []
        for i in range(a, b):
            if i == 0:
                out.append(None)
                continue
            tid = prompt.ids[i]
            entries = {str(tid): RankedLogprob(finite(prompt.logprobs[i - 1]), prompt.ranks[i - 1], prompt.text[tid])}
            for rank, (t, lp) in enumerate(prompt.top_ids_at(i, k), 1):
                entries.setdefault(str(t), RankedLogprob(lp, rank, prompt.text[t]))
            out.append(entries)
        return out

    return json_list(prompt.size, rows, max(1, _SLICE_ENTRIES // (k + 1)))


class CompletionAnswer(Answer):
    def __init__(self, rid: str, created: int, accepted: RequestAccepted) -> None:
        super().__init__(rid, created, accepted)
        self.offsets = [len(self._echo(c.index)) for c in self.choices]  # text_offset of each choice's next token
        self.echoed = [False] * len(self.choices)
        self.tokens_sent = [0] * len(self.choices)  # a stream: each choice's completion tokens as of its last event
        self.ids_sent = [False] * len(self.choices)  # return_token_ids: the choice's prompt ids went out already

    def _due(self, c: ChoiceState) -> bool:
        # A token whose bytes end inside a UTF-8 character adds no text until the next one; vLLM still sends its
        # chunk (text ""), and `vllm bench serve` times the first token and every inter-token gap by those chunks:
        # without it a held first token counts as prefill and two tokens' gap as one.
        return super()._due(c) or c.completion_tokens > self.tokens_sent[c.index]

    def _echo(self, index: int) -> str:
        return self.accepted.echoes[index] if self.accepted.echoes else self.accepted.echo

    def _logprobs(self, c: ChoiceState, prompt: PromptRows | None) -> _EchoLogprobs | None:
        """The choice's logprobs since the last write; takes the entries and advances the text offset now."""
        if not self.accepted.logprobs:
            return None
        k = self.accepted.echo_logprobs
        entries, c.logprobs = c.logprobs, []
        out = _EchoLogprobs(prompt if k is not None else None, k or 0, entries, self.offsets[c.index])
        self.offsets[c.index] += sum(len(e.token) for e in entries)
        return out

    def _text(self, c: ChoiceState) -> str:
        text = "".join(c.text)
        if not self.echoed[c.index]:  # echo: the prompt comes first, once
            self.echoed[c.index] = True
            text = self._echo(c.index) + text
        return text

    def _choice(self, c: ChoiceState, reason: str | None, whole: bool) -> Iterator[bytes]:
        """One ``CompletionChoice`` (the whole answer's also has vLLM's prompt_logprobs when asked for)."""
        prompt = PromptRows(c.prompt) if c.prompt is not None else None
        c.prompt = None  # the unpacked rows are all that is kept
        text, logprobs = self._text(c), self._logprobs(c, prompt)
        k = self.accepted.prompt_logprobs
        more = self._ids(c) if self.accepted.token_ids else b""
        if reason is not None:  # vLLM's stop_reason on the finishing choice
            more = b"," + key("stop_reason") + encode(c.stop_reason) + more
        return self._choice_pieces(c.index, text, logprobs, reason, prompt if whole and k is not None else None, k or 0,
                                   more)  # fmt: skip

    def _ids(self, c: ChoiceState) -> bytes:
        """vLLM's return_token_ids keys of a choice: its prompt's ids (once: a stream's first chunk of the choice)
        and its ids since the last write."""
        out = b""
        if not self.ids_sent[c.index]:
            self.ids_sent[c.index] = True
            prompts = self.accepted.prompt_token_ids
            out += b"," + key("prompt_token_ids") + encode(prompts[c.index] if len(prompts) > 1 else prompts[0])
        ids, c.token_ids = c.token_ids, []
        return out + b"," + key("token_ids") + encode(ids)

    @staticmethod
    def _choice_pieces(
        index: int, text: str, logprobs: _EchoLogprobs | None, reason: str | None, ranked: PromptRows | None, k: int,
        more: bytes = b"",
    ) -> Iterator[bytes]:
        yield b"{" + key("index") + encode(index) + b"," + key("text") + encode(text) + b"," + key("logprobs")
        if logprobs is None:
            yield b"null"
        else:
            yield from logprobs.pieces()
        yield b"," + key("finish_reason") + encode(reason) + more
        if ranked is not None:
            yield b"," + key("prompt_logprobs")
            yield from _ranked(ranked, k)
        yield b"}"

    def _document(self, choices: Iterable[Iterator[bytes]], usage: Usage | None) -> Iterator[bytes]:
        """A ``text_completion`` object: id, object, created, model, choices, then usage when there is one."""
        yield (b"{" + key("id") + encode(self.rid) + b"," + key("object") + b'"text_completion",' + key("created")
               + encode(self.created) + b"," + key("model") + encode(self.model) + b"," + key("choices") + b"[")
        for n, choice in enumerate(choices):
            if n:
                yield b","
            yield from choice
        yield b"]" + (b"," + key("usage") + encode(usage) if usage is not None else b"") + b"}"

    def _event(self, choices: list[Iterator[bytes]], usage: Usage | None) -> Iterator[bytes]:
        yield b"data: "
        yield from self._document(choices, usage)
        yield b"\n\n"

    def _chunk(self, c: ChoiceState) -> Iterable[bytes]:
        self.tokens_sent[c.index] = c.completion_tokens
        reason = c.finish_reason if self._finishing(c) else None
        return self._event([self._choice(c, reason, whole=False)], self.running_usage())

    def start(self) -> bytes:
        if not self.accepted.echo or self.accepted.echo_logprobs is not None:
            return b""  # with logprobs, the echo waits for the first output, which brings the prompt's
        choices = [self._choice_pieces(c.index, self._text(c), None, None, None, 0) for c in self.choices]
        return sse_event(b"".join(self._document(choices, None)))

    def _usage_event(self) -> bytes:
        return sse_event(b"".join(self._document([], self.usage())))

    def body(self) -> Iterator[bytes]:
        # One choice at a time: a choice's rows are unpacked when its turn comes.
        return self._document((self._choice(c, c.finish_reason, whole=True) for c in self.choices), self.usage())
