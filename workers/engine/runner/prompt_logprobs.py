"""Prompt log probabilities on the model worker: for a sequence that asked for them (``prompt_logprobs``,
what /v1/completions' ``echo`` with ``logprobs`` and lm-eval's loglikelihood need), every row of its prefill
chunks gives the log probability of the prompt's next token, its rank and the k best tokens there.

The numbers are the log-softmax, in float32 over the real vocabulary, of the raw logits: penalties, logit
bias and grammar masks shape what a request samples, and the prompt's tokens were not sampled. What crosses
to the scheduler is small, per row one float, one rank and k ids and floats, never a vocabulary row. Long
chunks are scored in slices of rows, so no step materialises [chunk, vocab] logits at once (a 4,096-token
chunk of a 152K vocabulary would be 2.5 GB in float32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ipc.logprob_messages import PromptLogprobs
from ipc.prompts import SamplingParams
from workers.engine.runner.batching import queued_to_host, to_device

if TYPE_CHECKING:
    from workers.engine.models.model_spec import ModelSpec

# Float32 logits one slice may hold: with Qwen's 151,936 tokens that is 883 rows (log-softmax doubles it).
SLICE_BYTES = 512 << 20
MAX_SLICE_ROWS = 1024

Logits = Callable[[torch.Tensor], torch.Tensor]  # hidden [N, H] -> float32 logits [N, vocab]


@dataclass
class PromptSpan:
    """Rows of one chunk to score: prompt positions ``start`` .. ``start + len(next_ids) - 1``."""

    rid: str
    start: int
    next_ids: list[int]  # the prompt token after each position: what its row is scored on
    k: int  # how many best tokens per position
    row: int  # the first position's row in the step's flattened batch

    @property
    def rows(self) -> range:
        return range(self.row, self.row + len(self.next_ids))


@dataclass
class ScoredPrompts:
    """A step's prompt log probabilities on their way to the host, row after row in the spans' order: queued
    copies (batching.queued_to_host), read with the step's sampled ids, so scoring a prompt does not make the
    worker wait for the forward before it plans the next step (sampler.LogprobRows does the same for samples)."""

    spans: list[PromptSpan]
    chosen: torch.Tensor  # float32 [rows]: the next prompt token's log probability
    ranks: torch.Tensor  # int64 [rows]
    top_values: torch.Tensor  # float32 [rows, k]: k the most any span asked for
    top_ids: torch.Tensor  # int64 [rows, k]
    copied: torch.cuda.Event | None = None

    def entries(self) -> list[PromptLogprobs]:
        if self.copied is not None:
            self.copied.synchronize()
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        out, at = [], 0
        for s in self.spans:
            rows = range(at, at + len(s.next_ids))
            out.append(PromptLogprobs(s.rid, s.start, chosen[at : rows.stop], ranks[at : rows.stop],
                                      [ids[r][: s.k] for r in rows], [values[r][: s.k] for r in rows]))  # fmt: skip
            at = rows.stop
        return out


class _Seq(Protocol):
    rid: str
    token_ids: list[int]
    sampling: SamplingParams
    prompt_until: int  # positions below it are scored: the prompt's length - 1 (0: none)


def span_for(seq: _Seq, start: int, end: int, row: int, spec: ModelSpec) -> PromptSpan | None:
    """The rows of the sequence's chunk [start, end) to score, the first at ``row`` of the step's batch. The
    last prompt position is not scored: it predicts the first sampled token (whose logprobs are the
    sampler's). The next token of a chunk's last row is the first of the next chunk: the worker has every
    prompt token from registration on. Image spans hold pad values above the vocabulary; they are scored as
    the image token (no endpoint asks for prompt logprobs of an image prompt today)."""
    stop, k = min(end, seq.prompt_until), seq.sampling.prompt_logprobs
    if k is None or stop <= start:
        return None
    vocab, pad = spec.vocab_size, spec.image_token_id
    nxt = [t if t < vocab else pad for t in seq.token_ids[start + 1 : stop + 1]]
    return PromptSpan(seq.rid, start, nxt, k, row)


def slice_rows(vocab: int) -> int:
    return max(1, min(MAX_SLICE_ROWS, SLICE_BYTES // (4 * max(1, vocab))))


@torch.inference_mode()
def score_prompts(
    hidden: torch.Tensor, spans: list[PromptSpan], logits_of: Logits, vocab: int, rank0: bool
) -> ScoredPrompts | None:
    """``hidden``: the final hidden states of every span's rows, span after span. Every TP rank calls this
    with the same slices (computing logits gathers over ranks); only rank 0 reduces them and returns the scores."""
    total = sum(len(s.next_ids) for s in spans)
    if total != hidden.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden rows for {total} prompt positions")
    device, k = hidden.device, max((s.k for s in spans), default=0)
    targets = to_device([torch.tensor([t for s in spans for t in s.next_ids])], device)  # pinned: no host wait
    chosen = torch.empty(total, dtype=torch.float32, device=device)
    ranks = torch.empty(total, dtype=torch.int64, device=device)
    top_values = torch.empty((total, k), dtype=torch.float32, device=device)
    top_ids = torch.empty((total, k), dtype=torch.int64, device=device)
    step = slice_rows(vocab)
    for lo in range(0, total, step):
        hi = min(total, lo + step)
        logits = logits_of(hidden[lo:hi])
        if not rank0:
            continue
        lp = torch.log_softmax(logits.float(), dim=-1)
        del logits
        picked = lp.gather(1, targets[lo:hi].unsqueeze(1))
        chosen[lo:hi] = picked.squeeze(1)
        ranks[lo:hi] = (lp > picked).sum(dim=1) + 1
        if k:
            torch.topk(lp, k, dim=-1, out=(top_values[lo:hi], top_ids[lo:hi]))
    if not rank0:
        return None
    (chosen, ranks, top_values, top_ids), copied = queued_to_host([chosen, ranks, top_values, top_ids])
    return ScoredPrompts(spans, chosen, ranks, top_values, top_ids, copied)
