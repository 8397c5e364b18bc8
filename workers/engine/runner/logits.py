"""Logit processing before sampling, batched over the rows of a step: logit_bias, min_tokens, and the
presence / frequency / repetition penalties.

Every operation is a handful of tensor ops over the whole [rows, vocab] batch, whatever the requests
ask for; Python touches only per-request lists that are as long as what the request sent (its bias
entries, its stop ids), never the vocabulary. Those lists reach the device through ``Pack``: one
float and one int64 copy per step, staged in pinned memory so they queue behind the forward instead
of waiting for it (a small ``torch.tensor(..., device=cuda)`` from pageable memory would stall the
host until the GPU drained its stream, once per tensor).

Penalties need the tokens each request has seen. ``PenaltyBook`` keeps them on the device as one
row per penalized request: output counts (int32) and a prompt-membership mask. A step gathers the
rows of its penalized requests and, once the tokens are sampled, adds them with one scatter, so
nothing crosses to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.runner.batching import to_device


class Pack:
    """Named host lists of one step, sent to the device in two non-blocking copies."""

    def __init__(self) -> None:
        self._floats: list[float] = []
        self._ints: list[int] = []
        self._at: dict[str, tuple[bool, int, int]] = {}
        self._f: torch.Tensor | None = None
        self._i: torch.Tensor | None = None

    def floats(self, name: str, values: Sequence[float]) -> None:
        self._at[name] = (True, len(self._floats), len(values))
        self._floats.extend(values)

    def ints(self, name: str, values: Sequence[int]) -> None:
        self._at[name] = (False, len(self._ints), len(values))
        self._ints.extend(values)

    def send(self, device: torch.device) -> Pack:
        self._f = to_device([torch.tensor(self._floats or [0.0], dtype=torch.float32)], device)
        self._i = to_device([torch.tensor(self._ints or [0], dtype=torch.int64)], device)
        return self

    def __getitem__(self, name: str) -> torch.Tensor:
        is_float, start, size = self._at[name]
        source = self._f if is_float else self._i
        assert source is not None, "Pack.send() first"
        return source[start : start + size]


class PenaltyBook:
    """Per-request token counts on the device, for the requests that have a penalty."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.rows: dict[str, int] = {}
        self._free: list[int] = []
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)

    def add(self, rid: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        row = self._row()
        self.rows[rid] = row
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        # Image spans hold pad values above the vocabulary: they are not tokens anyone could repeat.
        prompt = [t for t in prompt_ids if 0 <= t < self.vocab_size]
        if prompt:
            self.in_prompt[row, to_device([torch.tensor(prompt)], self.device)] = True
        if output_ids:
            ids = to_device([torch.tensor(list(output_ids))], self.device)
            self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def fork(self, parent: str, child: str) -> None:
        """The child starts with the parent's prompt and output so far."""
        src = self.rows[parent]
        row = self._row()
        self.rows[child] = row
        self.counts[row] = self.counts[src]
        self.in_prompt[row] = self.in_prompt[src]

    def remove(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is not None:
            self._free.append(row)

    def _row(self) -> int:
        if not self._free:
            # Grow by doubling: a copy now and then instead of one allocation per request.
            old = self.counts.shape[0]
            new = max(8, 2 * old)
            counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
            in_prompt = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
            counts[:old] = self.counts
            in_prompt[:old] = self.in_prompt
            self.counts, self.in_prompt = counts, in_prompt
            self._free = list(range(new - 1, old - 1, -1))
        return self._free.pop()

    @staticmethod
    def plan(pack: Pack, book_rows: list[int], batch_rows: list[int], rep: list[float], freq: list[float], pres: list[float]) -> None:
        pack.ints("pen_book", book_rows)
        pack.ints("pen_at", batch_rows)
        pack.floats("pen_rep", rep)
        pack.floats("pen_freq", freq)
        pack.floats("pen_pres", pres)

    def apply(self, logits: torch.Tensor, pack: Pack) -> None:
        """Penalize the planned rows of ``logits`` in place."""
        at = pack["pen_at"]
        counts = self.counts[pack["pen_book"]]
        seen = self.in_prompt[pack["pen_book"]] | (counts > 0)
        x = logits[at]
        rep = pack["pen_rep"].unsqueeze(1)
        # transformers' (CTRL's) rule: a penalty > 1 shrinks the logit toward less likely either way.
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - pack["pen_freq"].unsqueeze(1) * counts.to(x.dtype) - pack["pen_pres"].unsqueeze(1) * (counts > 0).to(x.dtype)
        logits[at] = x

    def record(self, tokens: torch.Tensor, pack: Pack) -> None:
        """Count the sampled ``tokens`` (device, one per batch row) of the planned rows."""
        rows, at = pack["pen_book"], pack["pen_at"]
        ones = torch.ones(at.shape[0], dtype=torch.int32, device=self.device)
        self.counts.index_put_((rows, tokens[at]), ones, accumulate=True)


def plan_logit_bias(pack: Pack, biases: list[tuple[tuple[int, float], ...]]) -> bool:
    """Queue every row's logit_bias entries; False when no row has any."""
    rows = [i for i, entries in enumerate(biases) for _ in entries]
    if not rows:
        return False
    pack.ints("bias_rows", rows)
    pack.ints("bias_cols", [token for entries in biases for token, _ in entries])
    pack.floats("bias", [value for entries in biases for _, value in entries])
    return True


def apply_logit_bias(logits: torch.Tensor, pack: Pack) -> None:
    logits.index_put_((pack["bias_rows"], pack["bias_cols"]), pack["bias"], accumulate=True)


def plan_stops(pack: Pack, rows: list[int], stop_ids: list[list[int]]) -> bool:
    """min_tokens: queue the stop tokens of ``rows`` to be made impossible; False when there are none."""
    r = [row for row, ids in zip(rows, stop_ids, strict=True) for _ in ids]
    if not r:
        return False
    pack.ints("stop_rows", r)
    pack.ints("stop_cols", [t for ids in stop_ids for t in ids])
    return True


def mask_stops(logits: torch.Tensor, pack: Pack) -> None:
    logits[pack["stop_rows"], pack["stop_cols"]] = float("-inf")
