"""Token sampling, batched over the rows of a step: logit processing (workers/engine/runner/logits.py),
greedy, temperature, min_p, top_k, top_p, per-request seeds, and log probabilities.

Order, as vLLM does it: logit_bias and min_tokens, then the penalties, then (sampled rows only)
temperature, min_p and top_k/top_p. Log probabilities are the log-softmax of the logits after the
penalties, biases and masks (what the token was really drawn from) and before temperature and the
truncations, so a greedy request's sampled token is always its top-1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ipc.logprob_messages import SampleLogprobs
from ipc.prompts import SamplingParams
from workers.engine.runner.batching import queued_to_host
from workers.engine.runner.logits import (
    Pack,
    PenaltyBook,
    apply_logit_bias,
    mask_stops,
    plan_logit_bias,
    plan_stops,
)
from workers.engine.runner.think_budget import ThinkBudgets

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
# A masking hook: logits [N, vocab] float32 -> None, in place. Structured outputs pass one; it runs
# before everything else, so every later step (and the log probabilities) sees only allowed tokens.
RowMask = Callable[[torch.Tensor], None]


@dataclass
class LogprobRows:
    """A step's log probabilities on their way to the host. Reading them at sampling time (``tolist``) would make
    the host wait for the whole forward, so a step asking for them could not be overlapped with planning the next
    (asynchronous scheduling): on CUDA they go by queued copies into pinned memory, and ``entries`` waits for
    those copies alone, when the worker reads the step's result."""

    rids: list[str]
    wants: list[int]  # top_logprobs asked for, per row
    chosen: torch.Tensor  # float32 [R]: the sampled token's
    top_values: torch.Tensor  # float32 [R, k]
    top_ids: torch.Tensor  # int64 [R, k]
    copied: torch.cuda.Event | None = None  # recorded after the copies (None: on the host already)

    @classmethod
    def queue(cls, rids: list[str], wants: list[int], chosen: torch.Tensor, top_values: torch.Tensor,
              top_ids: torch.Tensor) -> LogprobRows:  # fmt: skip
        (chosen, top_values, top_ids), copied = queued_to_host([chosen, top_values, top_ids])
        return cls(rids, wants, chosen, top_values, top_ids, copied)

    def entries(self) -> list[SampleLogprobs]:
        if self.copied is not None:
            self.copied.synchronize()
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        return [SampleLogprobs(rid, chosen[j], ids[j][:want], values[j][:want])
                for j, (rid, want) in enumerate(zip(self.rids, self.wants, strict=True))]  # fmt: skip


@dataclass
class SampleOutput:
    """The sampled ids stay on the device until ``tokens`` is read: a worker that schedules asynchronously feeds
    ``device`` to the next step's input before this step's ids reach the host; so do the log probabilities
    (``pending``) until ``logprobs`` is read."""

    device: torch.Tensor  # int64 [N]
    pending: LogprobRows | None = None
    _host: list[int] | None = None

    @property
    def tokens(self) -> list[int]:
        if self._host is None:
            self._host = self.device.tolist()
        return self._host

    @property
    def logprobs(self) -> list[SampleLogprobs]:
        return self.pending.entries() if self.pending is not None else []


class Sampler:
    """Samples one token per row of logits. Seeded requests get their own generator, so a seed
    reproduces the same tokens whatever else is batched with the request."""

    def __init__(
        self, device: torch.device, seed: int = 0, vocab_size: int = 0, eos_token_ids: Sequence[int] = ()
    ) -> None:
        self.device = device
        self._default = torch.Generator(device=device)
        self._default.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._generated: dict[str, int] = {}  # tokens sampled so far, for min_tokens
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self._penalties: PenaltyBook | None = None
        self._think: ThinkBudgets | None = None  # thinking_token_budget's per-request state, once one asks

    def add(
        self, rid: str, params: SamplingParams, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = ()
    ) -> None:
        self._seed(rid, params)
        self._generated[rid] = len(output_ids)
        if params.penalized:
            self._book().add(rid, prompt_ids, output_ids)
        if params.think_budget is not None:
            if self._think is None:
                self._think = ThinkBudgets(self.device)
            self._think.add(rid, params, output_ids)

    def fork(self, parent: str, child: str, params: SamplingParams) -> None:
        """A sequence that shares ``parent``'s prompt and samples its own tokens (n > 1). Its seed, when
        it has one, is its own (the caller offsets it per choice, as vLLM does)."""
        self._seed(child, params)
        self._generated[child] = self._generated.get(parent, 0)
        if params.penalized and self._penalties is not None and parent in self._penalties.rows:
            self._penalties.fork(parent, child)
        if self._think is not None:
            self._think.fork(parent, child)

    def _seed(self, rid: str, params: SamplingParams) -> None:
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self._generators[rid] = gen

    def _book(self) -> PenaltyBook:
        if self._penalties is None:
            if self.vocab_size <= 0:
                raise ValueError("penalties need the sampler to know the vocabulary size")
            self._penalties = PenaltyBook(self.vocab_size, self.device)
        return self._penalties

    def remove(self, rid: str) -> None:
        self._generators.pop(rid, None)
        self._generated.pop(rid, None)
        if self._penalties is not None:
            self._penalties.remove(rid)
        if self._think is not None:
            self._think.remove(rid)

    def sample(
        self,
        logits: torch.Tensor,
        rids: list[str],
        params: list[SamplingParams],
        mask: RowMask | None = None,
    ) -> SampleOutput:
        """``logits`` [N, vocab]; returns N token ids and the log probabilities asked for."""
        plain = mask is None and all(p.greedy and _plain(p) for p in params)
        if plain:
            self._count(rids)
            return SampleOutput(logits.argmax(dim=-1))
        # Every per-row number the step needs goes to the device in two copies that do not block.
        pack = Pack()
        plan = self._plan(pack, rids, params)
        _plan_draw(pack, params)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        pack.ints("lp_at", lp_rows)
        think_rows, think_slots = self._think.rows(rids) if self._think is not None else ([], [])
        pack.ints("think_rows", think_rows)
        pack.ints("think_slots", think_slots)
        pack.send(logits.device)
        logits = logits.to(torch.float32, copy=True)  # the steps below write in place
        if mask is not None:
            mask(logits)
        if plan.bias:
            apply_logit_bias(logits, pack)
        if plan.stops:
            mask_stops(logits, pack)
        if plan.penalties and self._penalties is not None:
            self._penalties.apply(logits, pack)
        if think_rows and self._think is not None:  # last: a forced end marker is all that is left to draw
            self._think.force(logits, pack["think_rows"], pack["think_slots"])
        tokens = self._draw(logits, rids, params, pack)
        if think_rows and self._think is not None:
            self._think.record(tokens, pack["think_rows"], pack["think_slots"])
        logprobs = self._logprobs(logits, tokens, rids, params, lp_rows, pack)
        out = SampleOutput(tokens, logprobs)
        self._count(rids)
        if plan.penalties and self._penalties is not None:
            self._penalties.record(tokens, pack)
        return out

    def _plan(self, pack: Pack, rids: list[str], params: list[SamplingParams]) -> _Plan:
        pack_plan = _Plan()
        pack_plan.bias = plan_logit_bias(pack, [p.logit_bias for p in params])
        rows, stops = [], []
        for i, (rid, p) in enumerate(zip(rids, params, strict=True)):
            if p.min_tokens and self._generated.get(rid, 0) < p.min_tokens:
                rows.append(i)
                stops.append([*([] if p.ignore_eos else self.eos_token_ids), *p.stop_token_ids])
        pack_plan.stops = plan_stops(pack, rows, stops)
        book = self._penalties
        penalized = [i for i, p in enumerate(params) if p.penalized and book is not None and rids[i] in book.rows]
        if penalized and book is not None:
            PenaltyBook.plan(
                pack,
                [book.rows[rids[i]] for i in penalized],
                penalized,
                [params[i].repetition_penalty for i in penalized],
                [params[i].frequency_penalty for i in penalized],
                [params[i].presence_penalty for i in penalized],
            )
            pack_plan.penalties = True
        return pack_plan

    def _draw(self, logits: torch.Tensor, rids: list[str], params: list[SamplingParams], pack: Pack) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            return greedy
        picked = [params[i] for i in sampled_rows]
        at = pack["draw_at"]
        x = logits[at] / pack["temperature"].unsqueeze(1)
        if any(p.min_p > 0 for p in picked):
            probs = torch.softmax(x, dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * pack["min_p"].unsqueeze(1)
            x = x.masked_fill(probs < floor, float("-inf"))
        if any(0 < p.top_k < x.shape[-1] or p.top_p < 1.0 for p in picked):
            x = _top_k_top_p(x, pack["top_k"], pack["top_p"])
        probs = torch.softmax(x, dim=-1)
        # Exponential race (argmax of p / E with E ~ Exp(1)) draws from p: one batched draw for the
        # unseeded rows, one per seeded row from its own generator (the seed's stream stays its own).
        race = torch.empty_like(probs).exponential_(generator=self._default)
        for j, i in enumerate(sampled_rows):
            gen = self._generators.get(rids[i])
            if gen is not None:
                race[j].exponential_(generator=gen)
        drawn = (probs / race).argmax(dim=-1)
        return greedy.index_copy(0, at, drawn)

    def _logprobs(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        rids: list[str],
        params: list[SamplingParams],
        rows: list[int],
        pack: Pack,
    ) -> LogprobRows | None:
        if not rows:
            return None
        at = pack["lp_at"]
        lp = torch.log_softmax(logits[at], dim=-1)
        chosen = lp.gather(1, tokens[at].unsqueeze(1)).squeeze(1)
        wants = [min(params[i].logprobs or 0, MAX_LOGPROBS) for i in rows]
        top = lp.topk(max(wants), dim=-1)  # k = 0 gives [R, 0]
        return LogprobRows.queue([rids[i] for i in rows], wants, chosen, top.values, top.indices)

    def _count(self, rids: list[str]) -> None:
        for rid in rids:
            if rid in self._generated:
                self._generated[rid] += 1


@dataclass
class _Plan:
    bias: bool = False
    stops: bool = False
    penalties: bool = False


def _plan_draw(pack: Pack, params: list[SamplingParams]) -> None:
    rows = [i for i, p in enumerate(params) if not p.greedy]
    pack.ints("draw_at", rows)
    pack.floats("temperature", [params[i].temperature for i in rows])
    pack.floats("min_p", [params[i].min_p for i in rows])
    pack.floats("top_p", [params[i].top_p for i in rows])
    pack.ints("top_k", [max(params[i].top_k, 0) for i in rows])  # 0: off


def _plain(p: SamplingParams) -> bool:
    """Nothing to do but the argmax (or a draw): no processing, no log probabilities."""
    return not (p.penalized or p.logit_bias or p.min_tokens or p.logprobs is not None or p.think_budget is not None)


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top_k and top_p for every row with one sort: rank >= k goes (k 0: none does), and so does the tail
    whose mass before it already reaches top_p (the best token always stays)."""
    vocab = x.shape[-1]
    ordered, order = torch.sort(x, dim=-1, descending=True)
    ks = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    ranks = torch.arange(vocab, device=x.device).unsqueeze(0)
    drop = ranks >= ks.unsqueeze(1)
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (torch.cumsum(probs, dim=-1) - probs) >= top_p.unsqueeze(1)
    drop[:, 0] = False
    return torch.full_like(x, float("-inf")).scatter(1, order, ordered.masked_fill(drop, float("-inf")))
