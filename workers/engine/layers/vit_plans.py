"""A ViT call's plan (rotary tables, window and frame bounds, reorder indices) kept on the device, by the call's grids.

Building a plan on the host and copying it over sits in front of the call's first kernel: for one 1080p image
(Qwen2.5-VL-7B shapes, H200) the tower took 34.5 ms from its call to its last kernel against 29.8 ms of kernels, and
pinning the plan's staging buffer alone took ~2.4 ms of host time per call. The calls of a server repeat a few grid
lists (a camera's or a scanner's page size, alone or two or three to a call), so their plans are kept, least
recently used first out, within a byte budget. It saves host time per call more than GPU time (the same call took
33.1-34.3 ms with it, on another machine). Plans are read-only inputs of the forward; nothing writes into a kept one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from torch import Tensor

from workers.engine.layers.vision_attention import Segments

P = TypeVar("P", bound=tuple[object, ...])

# Rotary tables dominate: [patches, head_dim / 2] float32 cos and sin, ~3.4 MB for a 1080p image (80-wide heads).
DEFAULT_BUDGET = 64 << 20


def plan_bytes(plan: tuple[object, ...]) -> int:
    """Device bytes a plan holds (views of one packed copy are counted each; an over-count, never an under-count)."""
    total = 0
    for part in plan:
        if isinstance(part, Tensor):
            total += part.nbytes
        elif isinstance(part, Segments):
            total += part.cu.nbytes
    return total


class CallPlans(Generic[P]):
    """Plans by key (the call's grids and device), least recently used evicted past ``budget`` bytes."""

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        self.budget = budget
        self.bytes = 0
        self._plans: OrderedDict[Hashable, tuple[P, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._plans)

    def resize(self, budget: int) -> None:
        """A new byte budget (``--vit-plan-cache-mb``; 0 keeps no plan), the oldest plans dropped past it."""
        self.budget = budget
        self._shrink()

    def _shrink(self) -> None:
        while self.bytes > self.budget:
            _, (_, dropped) = self._plans.popitem(last=False)
            self.bytes -= dropped

    def get(self, key: Hashable, build: Callable[[], P]) -> tuple[P, bool]:
        """The plan for ``key`` and whether it was kept; ``build`` makes a missing one (kept if it fits)."""
        entry = self._plans.get(key)
        if entry is not None:
            self._plans.move_to_end(key)
            return entry[0], True
        plan = build()
        size = plan_bytes(plan)
        if size <= self.budget:
            self._plans[key] = (plan, size)
            self.bytes += size
            self._shrink()
        return plan, False
