"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from ipc.messages import SamplingParams


class Sampler:
    """Samples one token per row of logits. Seeded requests get their own generator, so a seed
    reproduces the same tokens whatever else is batched with the request."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._default = torch.Generator(device=device)
        self._default.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def add(self, rid: str, params: SamplingParams) -> None:
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self._generators[rid] = gen

    def remove(self, rid: str) -> None:
        self._generators.pop(rid, None)

    def sample(self, logits: torch.Tensor, rids: list[str], params: list[SamplingParams]) -> list[int]:
        """``logits`` [N, vocab] float32; returns N token ids."""
        if all(p.greedy for p in params):
            return [int(t) for t in logits.argmax(dim=-1).tolist()]
        # Rows stay on the device until one read at the end: a read per row would be a host sync per row.
        picked: list[torch.Tensor] = []
        for row, rid, p in zip(logits, rids, params, strict=True):
            if p.greedy:
                picked.append(row.argmax().view(1))
                continue
            picked.append(self._sample_row(row, p, self._generators.get(rid, self._default)))
        return [int(t) for t in torch.cat(picked).tolist()]

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        """One draw for one row, as a 1-element device tensor."""
        scores = row.float() / p.temperature
        if p.top_k > 0 and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least the best token).
            drop = torch.cumsum(probs, dim=-1) - probs >= p.top_p
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=gen)
