"""vLLM's ``thinking_token_budget``: a reasoning model may write at most this many tokens between its start and end
markers (``<think>`` / ``</think>``); at the budget the end marker is forced, and the answer goes on from there.

Each request with a budget holds a slot of small device tensors: where it is (before the start marker, inside,
done), the thinking tokens it has left, and its two marker ids. A step forces the end marker on its rows that are
inside with none left, and after the draw moves each row on by the token it got. The state never leaves the
device, so a worker that schedules asynchronously (the step's tokens not on the host yet when the next is planned)
forces at exactly the budget; a request re-added after preemption rebuilds its state from its output on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ipc.prompts import SamplingParams

BEFORE, INSIDE, DONE = 0, 1, 2


def replay(params: SamplingParams, output_ids: Sequence[int]) -> tuple[int, int]:
    """(place, thinking tokens left) of a request that has generated ``output_ids`` (its start: inside the reasoning
    when its prompt opened it)."""
    start, end = params.think_ids
    place, left = (INSIDE if params.think_inside else BEFORE), params.think_budget or 0
    for token in output_ids:
        if place == BEFORE and token == start:
            place = INSIDE
        elif place == INSIDE:
            if token == end:
                place = DONE
            else:
                left -= 1
    return place, left


class ThinkBudgets:
    """The slots of the requests that have a thinking budget (rid -> slot), grown as needed."""

    def __init__(self, device: torch.device, capacity: int = 64) -> None:
        self.device = device
        self.slots: dict[str, int] = {}
        self._free: list[int] = []
        self.place = torch.zeros(0, dtype=torch.int64, device=device)
        self.left = torch.zeros(0, dtype=torch.int64, device=device)
        self.markers = torch.zeros((0, 2), dtype=torch.int64, device=device)
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        old = self.place.shape[0]
        for name in ("place", "left", "markers"):
            t = getattr(self, name)
            bigger = torch.zeros((capacity, *t.shape[1:]), dtype=t.dtype, device=self.device)
            bigger[:old] = t
            setattr(self, name, bigger)
        self._free.extend(range(capacity - 1, old - 1, -1))

    def _slot(self, rid: str) -> int:
        if not self._free:
            self._grow(2 * self.place.shape[0])
        slot = self._free.pop()
        self.slots[rid] = slot
        return slot

    def add(self, rid: str, params: SamplingParams, output_ids: Sequence[int] = ()) -> None:
        if params.think_budget is None:
            return
        place, left = replay(params, output_ids)
        slot = self._slot(rid)
        self.place[slot], self.left[slot] = place, left
        self.markers[slot] = torch.tensor(params.think_ids, dtype=torch.int64)

    def fork(self, parent: str, child: str) -> None:
        """An n > 1 choice starts where its parent is (before any token of its own)."""
        if parent not in self.slots:
            return
        src, dst = self.slots[parent], self._slot(child)
        for t in (self.place, self.left, self.markers):
            t[dst] = t[src]

    def remove(self, rid: str) -> None:
        slot = self.slots.pop(rid, None)
        if slot is not None:
            self._free.append(slot)

    def rows(self, rids: list[str]) -> tuple[list[int], list[int]]:
        """The step's rows that hold a budget, and their slots."""
        found = [(i, self.slots[rid]) for i, rid in enumerate(rids) if rid in self.slots]
        return [i for i, _ in found], [s for _, s in found]

    def force(self, logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """``logits`` [N, vocab] float32, in place: a row inside its reasoning with no budget left can only draw its
        end marker."""
        due = (self.place[slots] == INSIDE) & (self.left[slots] <= 0)
        picked = logits[rows]
        forced = torch.full_like(picked, float("-inf")).scatter_(1, self.markers[slots, 1:2], 0.0)
        logits[rows] = torch.where(due.unsqueeze(1), forced, picked)

    def record(self, tokens: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Move each row's state on by the token it drew."""
        token = tokens[rows]
        place, left = self.place[slots], self.left[slots]
        start, end = self.markers[slots, 0], self.markers[slots, 1]
        inside = place == INSIDE
        self.left[slots] = torch.where(inside & (token != end), left - 1, left)
        place = torch.where(inside & (token == end), DONE, place)
        self.place[slots] = torch.where((place == BEFORE) & (token == start), INSIDE, place)
