"""A callback the model worker sets while it launches a step, run between the step's layers and phases.

The worker queues a step planned ahead while the one before it still runs on the GPU, and reports that earlier
step once its GPU work is done. It used to look only between launches, so the earlier step's result waited until
the whole next launch had returned. On the Qwen3-VL-8B shape under load (64 requests of one 1080p image, H200,
2026-12-02, `GLIMPSE_STEP_TRACE`) a mixed step's launch kept the host as long as its GPU work (ViT and forward,
~100 ms), so every result reached the scheduler a step late, and one slow launch (182 ms) sent two results 5 ms
apart after a 180 ms gap: the stalls of (b)'s inter-token p99. Called here, the worker reports a finished step
within a layer's launch of its end.

Forward hooks on the language model's decoder layers and the vision tower's blocks call it (a step replayed from
CUDA graphs runs no Python per layer, and is quick to launch anyway), and the runner calls it between its phases.
Outside a launch nothing is set and the hooks do nothing (CUDA-graph captures at start-up run the layers too).
``GLIMPSE_LAUNCH_POLL=0`` turns it off (results are then reported between launches only), for an A/B.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from torch import nn


class LaunchPoll:
    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.callback: Callable[[], None] | None = None
        self.enabled = os.environ.get("GLIMPSE_LAUNCH_POLL", "1") != "0"
        for m in modules:
            m.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self()

    def __call__(self) -> None:
        if self.callback is not None:
            self.callback()

    @contextmanager
    def calling(self, callback: Callable[[], None]) -> Iterator[None]:
        """``callback`` runs at every poll point until the block ends."""
        self.callback = callback if self.enabled else None
        try:
            yield
        finally:
            self.callback = None


def poll_points(*towers: nn.Module | None) -> list[nn.Module]:
    """The decoder layers and vision blocks of ``towers`` (``layers`` or ``blocks`` lists), in order."""
    out: list[nn.Module] = []
    for tower in towers:
        for name in ("layers", "blocks"):
            mods = getattr(tower, name, None) if tower is not None else None
            if isinstance(mods, nn.ModuleList):
                out.extend(mods)
    return out
