"""Log-probability records that ride inside other messages (StepResult, RequestOutput)."""

from __future__ import annotations

import msgspec

# JSON has no -inf; OpenAI (and vLLM) report a token that cannot be sampled with this value.
LOGPROB_FLOOR = -9999.0


class SampleLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Model worker -> scheduler: log probabilities of one sampled token (token ids, not text yet)."""

    rid: str
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Model worker -> scheduler: log probabilities of prompt tokens ``start + 1`` onwards (one entry per
    position of a prefill chunk), each given the tokens before it, with its rank and the k best there."""

    rid: str
    start: int
    logprobs: list[float]
    ranks: list[int]  # 1 + how many tokens were more likely
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class PromptLogprob(msgspec.Struct, frozen=True, array_like=True):
    """Scheduler -> frontend: one prompt's log probabilities, packed (``array`` typecodes "i" and "f", native
    byte order: every process of a launch runs on one host). float32 loses nothing: the model worker's
    numbers are float32 already. The frontend renders OpenAI's and vLLM's JSON from these in slices, so a
    large prompt never exists as millions of Python objects, neither here nor there (issue 40).

    Position 0 of ``token_ids`` has no entry in the other arrays (nothing comes before it); position i >= 1
    has ``logprobs[i - 1]``, ``ranks[i - 1]`` and ``k`` alternatives at ``top_*[(i - 1) * k : i * k]``,
    best first. ``texts`` holds the token text of every id these arrays name (``vocab_ids`` in the same order).
    """

    token_ids: bytes  # int32
    logprobs: bytes  # float32; -inf stays -inf (the frontend writes JSON's stand-in)
    ranks: bytes  # int32: 1 + how many tokens were more likely
    k: int
    top_ids: bytes  # int32
    top_logprobs: bytes  # float32
    vocab_ids: bytes  # int32
    texts: list[str]


class TopLogprob(msgspec.Struct, frozen=True):
    """OpenAI's ``top_logprobs`` entry, as the scheduler renders it (the frontend copies it into JSON)."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct, frozen=True):
    """OpenAI's ``logprobs.content[]`` entry of one generated token."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]
