"""Answers assembled from a request's ``RequestOutput``s: n choices, log probabilities, tool calls, for
/v1/chat/completions (the /v1/completions shapes are server/completion_answer.py's), streamed (SSE events as
outputs arrive) or whole.

Outputs of all choices arrive interleaved on the request's flight queue; each carries its choice's
index. An ``Answer`` keeps what each choice has produced since the last flush, and knows the request
is over when every choice has a finish reason.

``flush`` and ``body`` hand back their bytes as an iterable of pieces, rendered as the caller takes them:
a large answer (a long prompt's log probabilities) is written in slices, never held whole (issue 40).
A whole answer keeps what it has compact until then: text joined, tool-call pieces merged per call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain

from ipc.control import RequestFailed
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
    ChunkChoiceWithIds,
    Delta,
    FunctionCall,
    ToolCall,
    ToolCallDeltaOut,
    Usage,
    encode,
    sse_event,
)

_COMPACT_AT = 64  # pieces a choice keeps before they are joined (a whole answer of 32K steps: 32K objects)


@dataclass
class ChoiceState:
    index: int
    text: list[str] = field(default_factory=list)  # stream: since the last flush; else everything
    reasoning: list[str] = field(default_factory=list)  # --reasoning-parser: the same, of the reasoning
    logprobs: list[TokenLogprob] = field(default_factory=list)
    calls: list[ToolCallDelta] = field(default_factory=list)
    prompt: PromptLogprob | None = None  # completions: the prompt's log probabilities (packed), until written
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that finished the choice
    finish_sent: bool = False
    completion_tokens: int = 0
    reasoning_tokens: int | None = None  # --reasoning-parser only
    token_ids: list[int] = field(default_factory=list)  # return_token_ids: as ``text`` (stream: since the last flush)


class Answer:
    """One request's answer; subclasses write the endpoint's shapes."""

    ENDS_WITH_DONE = True  # a stream ends with ``data: [DONE]`` (OpenAI's chat and completions; not its Responses)

    def __init__(self, rid: str, created: int, accepted: RequestAccepted) -> None:
        self.rid, self.created, self.accepted = rid, created, accepted
        self.model = accepted.model
        self.choices = [ChoiceState(i) for i in range(max(1, accepted.n))]
        self.prompt_tokens = accepted.prompt_tokens
        self.cached_tokens: int | None = None  # the scheduler's count arrives with the first output

    def add(self, out: RequestOutput) -> None:
        choice = self.choices[out.index]
        if out.text:
            choice.text.append(out.text)
            if len(choice.text) > _COMPACT_AT:  # a whole answer: one string, not a Python object per step
                choice.text[:] = ["".join(choice.text)]
        if out.reasoning and self.accepted.reasoning:
            choice.reasoning.append(out.reasoning)
            if len(choice.reasoning) > _COMPACT_AT:
                choice.reasoning[:] = ["".join(choice.reasoning)]
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        if out.tool_calls:
            choice.calls.extend(out.tool_calls)
            if len(choice.calls) > _COMPACT_AT and not self.accepted.stream:
                choice.calls[:] = _merged(choice.calls)
        if out.prompt_logprobs is not None:
            choice.prompt = out.prompt_logprobs
        if self.accepted.token_ids:
            choice.token_ids.extend(out.token_ids)
        choice.completion_tokens = out.completion_tokens
        if out.reasoning_tokens is not None:
            choice.reasoning_tokens = out.reasoning_tokens
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        if out.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> Usage:
        counted = [c.reasoning_tokens for c in self.choices if c.reasoning_tokens is not None]
        usage = Usage.of(self.prompt_tokens, sum(c.completion_tokens for c in self.choices), self.cached_tokens or 0,
                         sum(counted) if counted else None)
        if self.cached_tokens is None:  # no output yet (a stream's first chunk): not known, so not said to be 0
            usage.prompt_tokens_details = None
        return usage

    def running_usage(self) -> Usage | None:
        """stream_options.continuous_usage_stats: the usage so far, on every chunk."""
        return self.usage() if self.accepted.continuous_usage else None

    def start(self) -> bytes:
        """What a stream begins with (before any output)."""
        return b""

    def flush(self) -> Iterator[bytes]:
        """Stream: events for everything added since the last flush; after the last output, the end too. Each
        choice's event takes what it needs now (``_chunk``), so its pieces may be rendered after the clearing."""
        events = [self._chunk(c) for c in self.choices if self._due(c)]
        for c in self.choices:
            c.text = []
            c.reasoning = []
            c.logprobs = []
            c.calls = []
            c.prompt = None
            c.token_ids = []
            c.finish_sent = c.finish_reason is not None
        tail = []
        if self.done:
            if self.accepted.include_usage:
                tail.append(self._usage_event())
            if self.ENDS_WITH_DONE:
                tail.append(SSE_DONE)
        return chain(*events, tail)

    def failure(self, failed: RequestFailed) -> list[bytes]:
        """A stream's end when the request failed after its status line went out: the error as an event, in the
        endpoint's own shape (OpenAI's chat and completions: ``data: {"error": ...}``, then ``[DONE]``)."""
        return [protocol.error_event(failed), *([SSE_DONE] if self.ENDS_WITH_DONE else [])]

    def _due(self, c: ChoiceState) -> bool:
        """Whether choice ``c`` has an event to send now: anything new, or its finish."""
        return bool(c.text or c.reasoning or c.logprobs or c.calls or c.prompt) or self._finishing(c)

    @staticmethod
    def _finishing(c: ChoiceState) -> bool:
        return c.finish_reason is not None and not c.finish_sent

    def _chunk(self, c: ChoiceState) -> Iterable[bytes]:
        raise NotImplementedError

    def _usage_event(self) -> bytes:
        raise NotImplementedError

    def body(self) -> Iterator[bytes]:
        """Not streamed: the whole answer, once ``done``, in pieces."""
        raise NotImplementedError


class ChatAnswer(Answer):
    def __init__(self, rid: str, created: int, accepted: RequestAccepted) -> None:
        super().__init__(rid, created, accepted)
        self.tokens_sent = [0] * len(self.choices)  # a stream: each choice's completion tokens as of its last event
        self.called = [False] * len(self.choices)  # a stream: the choice has sent tool-call deltas

    def prompt_ids(self, index: int) -> list[int]:
        """return_token_ids: choice ``index``'s prompt (a batch's own, else the one every choice shares)."""
        ids = self.accepted.prompt_token_ids
        return ids[index] if len(ids) > 1 else ids[0]

    def start(self) -> bytes:
        # return_token_ids: the prompt's ids ride on the first chunk, as vLLM sends them.
        prompt = self.prompt_ids(0) if self.accepted.token_ids else None
        return b"".join(self._event([self._chunk_choice(c, Delta(role="assistant", content=""))], prompt=prompt)
                        for c in self.choices)  # fmt: skip

    def _chunk_choice(self, c: ChoiceState, delta: Delta, reason: str | None = None,
                      logprobs: ChoiceLogprobs | None = None) -> ChunkChoice:
        stop = c.stop_reason if reason is not None else None  # on the finishing chunk, as vLLM sends it
        if not self.accepted.token_ids:
            return ChunkChoice(c.index, delta, reason, logprobs, stop)
        ids, c.token_ids = c.token_ids, []  # a chunk's ids are those new since the one before
        return ChunkChoiceWithIds(c.index, delta, reason, logprobs, stop, ids)

    def _held(self, c: ChoiceState) -> bool:
        """New tokens that added no text yet (their bytes end inside a UTF-8 character). vLLM still streams their
        chunk (``content: ""``) and `vllm bench serve` counts each chunk as an inter-token gap. Not with a reasoning
        parser or once tool calls came (their markers and argument text add nothing either, and vLLM's parsers
        answer such tokens with no chunk)."""
        return c.completion_tokens > self.tokens_sent[c.index] and c.reasoning_tokens is None and not self.called[c.index]

    def _due(self, c: ChoiceState) -> bool:
        return super()._due(c) or self._held(c) or bool(c.token_ids)

    def _event(self, choices: list[ChunkChoice], usage: Usage | None = None, prompt: list[int] | None = None) -> bytes:
        usage = usage or self.running_usage()
        chunk = protocol.ChatCompletionChunk(self.rid, "chat.completion.chunk", self.created, self.model, choices, usage,
                                             prompt)  # fmt: skip
        return sse_event(encode(chunk))

    def _logprobs(self, c: ChoiceState) -> ChoiceLogprobs | None:
        return ChoiceLogprobs(list(c.logprobs)) if self.accepted.logprobs else None

    def _chunk(self, c: ChoiceState) -> Iterable[bytes]:
        text = "".join(c.text)
        thought = "".join(c.reasoning) or None
        calls = [_call_delta(d) for d in c.calls] or None
        out = b""
        held = self._held(c)
        self.tokens_sent[c.index] = c.completion_tokens
        self.called[c.index] = self.called[c.index] or bool(calls)
        if text or thought or calls or c.logprobs or held or c.token_ids:
            delta = Delta(content=text if text or not (calls or thought) else None, reasoning_content=thought,
                          reasoning=thought, tool_calls=calls)
            out = self._event([self._chunk_choice(c, delta, None, self._logprobs(c))])
        if self._finishing(c):  # as OpenAI ends a choice: an empty delta with the finish reason
            out += self._event([self._chunk_choice(c, Delta(), c.finish_reason)])
        return [out]

    def _usage_event(self) -> bytes:
        return self._event([], self.usage())

    def body(self) -> Iterator[bytes]:
        choices: list[protocol.Choice] = []
        for c in self.choices:
            calls = whole_calls(c.calls)
            text = "".join(c.text)
            thought = "".join(c.reasoning) or None
            message = AssistantMessage(role="assistant", content=text if text or not (calls or thought) else None,
                                       reasoning_content=thought, reasoning=thought, tool_calls=calls)
            if self.accepted.token_ids:
                choices.append(protocol.ChoiceWithIds(c.index, message, c.finish_reason, self._logprobs(c),
                                                      c.stop_reason, c.token_ids))
            else:
                choices.append(protocol.Choice(c.index, message, c.finish_reason, self._logprobs(c), c.stop_reason))
        if self.accepted.token_ids:
            yield encode(protocol.ChatCompletionWithIds(id=self.rid, created=self.created, model=self.model,
                                                        choices=choices, usage=self.usage(),
                                                        prompt_token_ids=self.prompt_ids(0)))  # fmt: skip
            return
        yield encode(ChatCompletion(id=self.rid, created=self.created, model=self.model, choices=choices, usage=self.usage()))


def _call_delta(d: ToolCallDelta) -> ToolCallDeltaOut:
    if d.id:
        return ToolCallDeltaOut(d.index, d.id, "function", FunctionCall(d.name, d.arguments))
    return ToolCallDeltaOut(d.index, function=FunctionCall(arguments=d.arguments))


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One delta per call (its id, name and all its argument text so far): what ``whole_calls`` makes of them."""
    calls: dict[int, list[ToolCallDelta]] = {}
    for d in deltas:
        calls.setdefault(d.index, []).append(d)
    return [ToolCallDelta(i, ds[0].id, ds[0].name, "".join(d.arguments for d in ds)) for i, ds in calls.items()]


def whole_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        call = calls.get(d.index)
        if call is None:
            calls[d.index] = ToolCall(d.id, FunctionCall(d.name, d.arguments))
        else:
            call.function.arguments = (call.function.arguments or "") + (d.arguments or "")
    return [calls[i] for i in sorted(calls)]
