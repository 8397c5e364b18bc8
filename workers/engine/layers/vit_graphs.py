"""CUDA graphs for a vision tower's recurring calls.

A small ViT call is host-bound: Gemma 4's published tower (27 layers of width 1152) spends 29 ms of host time on
one 1080p image at budget 280 for about 10 ms of GPU work, even with each layer as two compiled pieces (H200,
``benchmarks/engine/gemma4_vit_bench.py``). Most calls repeat: every 1080p photo at a budget has the same patch
grid, so a multi-turn chat's new image each round is the same call as the last one's. A call whose grids (the
tower's ``key``) come back is captured into a CUDA graph on its second sighting (the first ran eagerly, so its
compiled kernels exist and nothing compiles inside the capture) and replayed from then on: the pixels are copied
into the graph's input buffer, the output is cloned out of its pool.

Bounds: calls of at most MAX_PATCHES patch rows (one large image: the activations of bigger calls would sit in the
pool for good, and their GPU time dwarfs the host's anyway) and MAX_GRAPHS graphs, least recently used dropped.
All graphs share one memory pool: they replay one at a time on one stream and each output is cloned before the
next replay, so their activations can overlap. A capture that fails (a kernel that cannot be captured) turns the
graphs off for the tower, with one warning, and the call runs eagerly. ``GLIMPSE_VIT_GRAPHS=0`` turns them off.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

ENV = "GLIMPSE_VIT_GRAPHS"
MAX_PATCHES = 4096  # rows of one call: a 1080p image at Gemma's budget 280 is 2,376; at 560, 4,743 (eager)
MAX_GRAPHS = 8
SEEN = 1024  # keys remembered as seen once (least recently seen forgotten)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    pixels: Tensor  # the input buffer the graph reads
    out: Tensor  # the output the graph writes (in the pool)


def replays(tower: object) -> int:
    """Calls of ``tower`` (any vision tower, or None) replayed from its graphs so far (0 where it has none)."""
    graphs = getattr(tower, "graphs", None)
    return graphs.replays if isinstance(graphs, ViTGraphs) else 0


class ViTGraphs:
    """One tower's captured calls, by key."""

    def __init__(self, max_patches: int = MAX_PATCHES, max_graphs: int = MAX_GRAPHS) -> None:
        self.max_patches, self.max_graphs = max_patches, max_graphs
        self.on = os.environ.get(ENV, "1") != "0"
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._pool: Any = None  # torch.cuda.graph_pool_handle(), made at the first capture
        self.captured = self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def wanted(self, pixels: Tensor) -> bool:
        return (
            self.on
            and pixels.is_cuda
            and 0 < pixels.shape[0] <= self.max_patches
            and not torch.cuda.is_current_stream_capturing()
        )

    def run(self, key: Hashable, pixels: Tensor, encode: Callable[[Tensor], Tensor]) -> Tensor:
        """``encode(pixels)``: eagerly, or from the graph of ``key`` (captured here on its second sighting). The key
        must fix the pixels' shape and dtype (the call's grids and dtype)."""
        if not self.wanted(pixels):
            return encode(pixels)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > SEEN:
                    self._seen.popitem(last=False)
                return encode(pixels)
            entry = self._capture(key, pixels, encode)
            if entry is None:
                return encode(pixels)
        else:
            self._graphs.move_to_end(key)
        entry.pixels.copy_(pixels, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.out.clone()

    def _capture(self, key: Hashable, pixels: Tensor, encode: Callable[[Tensor], Tensor]) -> _Graph | None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static = pixels.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a worker's other threads (NCCL's watchdog, copies) keep working during the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = encode(static)
        except Exception as exc:  # noqa: BLE001 - any failure: serve eagerly rather than fail the request
            self.on = False
            self._graphs.clear()
            log.warning("ViT CUDA graphs off (%s=0 to skip the attempt): capture failed: %s", ENV, exc)
            return None
        entry = _Graph(graph, static, out)
        self._graphs[key] = entry
        self.captured += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry
