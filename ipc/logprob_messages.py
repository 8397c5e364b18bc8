"""Log-probability records that ride inside other messages (StepResult, RequestOutput); re-exported by
ipc/messages.py, where every message is looked up."""

from __future__ import annotations

import msgspec


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
    """Scheduler -> frontend: one prompt token, rendered. The first token has no logprob (nothing before it)."""

    token_id: int
    token: str
    logprob: float | None
    rank: int
    top: list[tuple[int, str, float]]  # (token id, token text, logprob) of the k best, best first


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
