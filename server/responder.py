"""Answers assembled from a request's ``RequestOutput``s: n choices, log probabilities, tool calls, for
/v1/chat/completions and /v1/completions, streamed (SSE events as outputs arrive) or whole.

Outputs of all choices arrive interleaved on the request's flight queue; each carries its choice's
index. An ``Answer`` keeps what each choice has produced since the last flush, and knows the request
is over when every choice has a finish reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from ipc.logprob_messages import PromptLogprob, TokenLogprob
from ipc.outputs import RequestOutput, ToolCallDelta
from ipc.requests import RequestAccepted
from server import protocol
from server.protocol import (
    SSE_DONE,
    AssistantMessage,
    ChatCompletion,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    FunctionCall,
    ToolCall,
    ToolCallDeltaOut,
    Usage,
    encode,
    sse_event,
)


@dataclass
class ChoiceState:
    index: int
    text: list[str] = field(default_factory=list)  # stream: since the last flush; else everything
    logprobs: list[TokenLogprob] = field(default_factory=list)
    calls: list[ToolCallDelta] = field(default_factory=list)
    prompt: list[PromptLogprob] | None = None  # completions: the prompt's log probabilities, until written
    finish_reason: str | None = None
    finish_sent: bool = False
    completion_tokens: int = 0


class Answer:
    """One request's answer; subclasses write the endpoint's shapes."""

    def __init__(self, rid: str, created: int, accepted: RequestAccepted) -> None:
        self.rid, self.created, self.accepted = rid, created, accepted
        self.model = accepted.model
        self.choices = [ChoiceState(i) for i in range(max(1, accepted.n))]
        self.prompt_tokens = accepted.prompt_tokens
        self.cached_tokens = 0

    def add(self, out: RequestOutput) -> None:
        choice = self.choices[out.index]
        if out.text:
            choice.text.append(out.text)
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        if out.tool_calls:
            choice.calls.extend(out.tool_calls)
        if out.prompt_logprobs is not None:
            choice.prompt = out.prompt_logprobs
        choice.completion_tokens = out.completion_tokens
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        if out.finish_reason is not None:
            choice.finish_reason = out.finish_reason

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, sum(c.completion_tokens for c in self.choices), self.cached_tokens)

    def running_usage(self) -> Usage | None:
        """stream_options.continuous_usage_stats: the usage so far, on every chunk."""
        return self.usage() if self.accepted.continuous_usage else None

    def start(self) -> bytes:
        """What a stream begins with (before any output)."""
        return b""

    def flush(self) -> bytes:
        """Stream: events for everything added since the last flush; after the last output, the end too."""
        events = [self._chunk(c) for c in self.choices if c.text or c.logprobs or c.calls or c.prompt or self._finishing(c)]
        for c in self.choices:
            c.text.clear()
            c.logprobs.clear()
            c.calls.clear()
            c.prompt = None
            c.finish_sent = c.finish_reason is not None
        if self.done:
            if self.accepted.include_usage:
                events.append(self._usage_event())
            events.append(SSE_DONE)
        return b"".join(events)

    @staticmethod
    def _finishing(c: ChoiceState) -> bool:
        return c.finish_reason is not None and not c.finish_sent

    def _chunk(self, c: ChoiceState) -> bytes:
        raise NotImplementedError

    def _usage_event(self) -> bytes:
        raise NotImplementedError

    def body(self) -> bytes:
        """Not streamed: the whole answer, once ``done``."""
        raise NotImplementedError


class ChatAnswer(Answer):
    def start(self) -> bytes:
        return b"".join(self._event([ChunkChoice(c.index, Delta(role="assistant", content=""))]) for c in self.choices)

    def _event(self, choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        usage = usage or self.running_usage()
        chunk = protocol.ChatCompletionChunk(self.rid, "chat.completion.chunk", self.created, self.model, choices, usage)
        return sse_event(encode(chunk))

    def _logprobs(self, c: ChoiceState) -> ChoiceLogprobs | None:
        return ChoiceLogprobs(list(c.logprobs)) if self.accepted.logprobs else None

    def _chunk(self, c: ChoiceState) -> bytes:
        text = "".join(c.text)
        calls = [_call_delta(d) for d in c.calls] or None
        out = b""
        if text or calls or c.logprobs:
            delta = Delta(content=text if text or not calls else None, tool_calls=calls)
            out = self._event([ChunkChoice(c.index, delta, None, self._logprobs(c))])
        if self._finishing(c):  # as OpenAI ends a choice: an empty delta with the finish reason
            out += self._event([ChunkChoice(c.index, Delta(), c.finish_reason)])
        return out

    def _usage_event(self) -> bytes:
        return self._event([], self.usage())

    def body(self) -> bytes:
        choices = []
        for c in self.choices:
            calls = _whole_calls(c.calls)
            text = "".join(c.text)
            message = AssistantMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls)
            choices.append(protocol.Choice(c.index, message, c.finish_reason, self._logprobs(c)))
        return encode(ChatCompletion(id=self.rid, created=self.created, model=self.model, choices=choices, usage=self.usage()))


def _call_delta(d: ToolCallDelta) -> ToolCallDeltaOut:
    if d.id:
        return ToolCallDeltaOut(d.index, d.id, "function", FunctionCall(d.name, d.arguments))
    return ToolCallDeltaOut(d.index, function=FunctionCall(arguments=d.arguments))


def _whole_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        call = calls.get(d.index)
        if call is None:
            calls[d.index] = ToolCall(d.id, FunctionCall(d.name, d.arguments))
        else:
            call.function.arguments = (call.function.arguments or "") + (d.arguments or "")
    return [calls[i] for i in sorted(calls)]


# ---- /v1/completions ------------------------------------------------------------------------------


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


class CompletionChoice(msgspec.Struct, omit_defaults=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # vLLM's extension, only when asked for: None for the first token, then {token id: entry} per token.
    prompt_logprobs: list[dict[str, RankedLogprob] | None] | None = None


class Completion(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def with_chosen(top: dict[str, float], token: str, logprob: float) -> dict[str, float]:
    """OpenAI's legacy completions always list the chosen token among a position's alternatives, so there may be
    logprobs + 1 of them."""
    top.setdefault(token, logprob)
    return top


class CompletionAnswer(Answer):
    def __init__(self, rid: str, created: int, accepted: RequestAccepted) -> None:
        super().__init__(rid, created, accepted)
        self.offsets = [len(self._echo(c.index)) for c in self.choices]  # text_offset of each choice's next token
        self.echoed = [False] * len(self.choices)

    def _echo(self, index: int) -> str:
        return self.accepted.echoes[index] if self.accepted.echoes else self.accepted.echo

    def _logprobs(self, c: ChoiceState) -> CompletionLogprobs | None:
        if not self.accepted.logprobs:
            return None
        out = CompletionLogprobs([], [], [], [])
        k = self.accepted.echo_logprobs
        if k is not None and c.prompt:  # echo: the prompt's tokens first, the first one with nothing before it
            offset = 0
            for p in c.prompt:
                out.tokens.append(p.token)
                out.token_logprobs.append(p.logprob)
                out.top_logprobs.append(None if p.logprob is None else with_chosen(
                    {text: lp for _, text, lp in p.top[:k]}, p.token, p.logprob
                ))  # fmt: skip
                out.text_offset.append(offset)
                offset += len(p.token)
        for entry in c.logprobs:
            out.tokens.append(entry.token)
            out.token_logprobs.append(entry.logprob)
            out.top_logprobs.append(with_chosen({t.token: t.logprob for t in entry.top_logprobs}, entry.token, entry.logprob))
            out.text_offset.append(self.offsets[c.index])
            self.offsets[c.index] += len(entry.token)
        return out

    def _text(self, c: ChoiceState) -> str:
        text = "".join(c.text)
        if not self.echoed[c.index]:  # echo: the prompt comes first, once
            self.echoed[c.index] = True
            text = self._echo(c.index) + text
        return text

    def _ranked(self, c: ChoiceState) -> list[dict[str, RankedLogprob] | None] | None:
        """vLLM's prompt_logprobs: per token after the first, the token itself and the k best there."""
        k = self.accepted.prompt_logprobs
        if k is None or not c.prompt:
            return None
        out: list[dict[str, RankedLogprob] | None] = [None]
        for p in c.prompt[1:]:
            entries = {str(p.token_id): RankedLogprob(p.logprob or 0.0, p.rank, p.token)}
            for rank, (tid, text, lp) in enumerate(p.top[:k], 1):
                entries.setdefault(str(tid), RankedLogprob(lp, rank, text))
            out.append(entries)
        return out

    def _chunk(self, c: ChoiceState) -> bytes:
        reason = c.finish_reason if self._finishing(c) else None
        choice = CompletionChoice(c.index, self._text(c), self._logprobs(c), reason)
        return sse_event(encode(Completion(
            id=self.rid, object="text_completion", created=self.created, model=self.model, choices=[choice],
            usage=self.running_usage(),
        )))  # fmt: skip

    def start(self) -> bytes:
        if not self.accepted.echo or self.accepted.echo_logprobs is not None:
            return b""  # with logprobs, the echo waits for the first output, which brings the prompt's
        choices = [CompletionChoice(c.index, self._text(c), None, None) for c in self.choices]
        return sse_event(encode(Completion(id=self.rid, object="text_completion", created=self.created, model=self.model, choices=choices)))

    def _usage_event(self) -> bytes:
        return sse_event(
            encode(Completion(id=self.rid, object="text_completion", created=self.created, model=self.model, choices=[], usage=self.usage()))
        )

    def body(self) -> bytes:
        choices = [
            CompletionChoice(c.index, self._text(c), self._logprobs(c), c.finish_reason, self._ranked(c)) for c in self.choices
        ]
        return encode(
            Completion(id=self.rid, object="text_completion", created=self.created, model=self.model, choices=choices, usage=self.usage())
        )


def answer_for(rid: str, created: int, accepted: RequestAccepted) -> Answer:
    cls = CompletionAnswer if accepted.endpoint == "completion" else ChatAnswer
    return cls(rid, created, accepted)
