"""The scheduler -> frontend hop: each step's new text per request, detokenized, with what rides along.

A ``RequestOutput`` is incremental (the text since the last one, UTF-8 safe) and may carry the tokens' log
probabilities, parsed tool-call pieces and, with a choice's first output, the prompt's log probabilities; the
outputs of one step travel together in an ``OutputBatch``.
"""

from __future__ import annotations

import msgspec

from ipc.control import Msg
from ipc.logprob_messages import PromptLogprob, TokenLogprob


class ToolCallDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    """A piece of a tool call parsed from the model's output: the first piece of call ``index`` carries its
    id and function name, later ones more argument text (OpenAI's streamed ``tool_calls`` deltas)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


class RequestOutput(msgspec.Struct, frozen=True):
    """New text of one request since the last output (incremental, UTF-8 safe)."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one entry per token of token_ids, when asked for
    index: int = 0  # the choice (n > 1)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    tool_calls: list[ToolCallDelta] | None = None
    prompt_logprobs: PromptLogprob | None = None  # with the choice's first output, when asked for (packed)
    reasoning: str = ""  # --reasoning-parser: the new text's reasoning part (``text`` is then the content alone)
    reasoning_tokens: int | None = None  # --reasoning-parser: the choice's reasoning tokens so far (None: no parser)
    # With logprobs: the ids of each token's alternatives, flat (its top_logprobs' count per token, in their order).
    # OpenAI's shapes name tokens by text; SGLang's /generate names them by id.
    top_ids: list[int] | None = None
    # With finish_reason "stop": the stop string that matched or the stop_token_ids entry sampled (vLLM's
    # stop_reason); None for an end-of-sequence token.
    stop_reason: str | int | None = None


class OutputBatch(Msg, frozen=True):
    """Scheduler -> frontend: the outputs of one step."""

    outputs: list[RequestOutput]
