"""CUDA graphs for the language model's pure-decode steps.

A decode step launches ~50 kernels per layer (about 1,400 on a 7B) around a few milliseconds of GPU
work, so at decode batch sizes the step is bound by Python and launch latency, not by the GPU.
Replaying a captured graph issues all of them with one call.

A graph fixes shapes and addresses, so:
- each graph reads its inputs from one static int64 buffer, refilled by one host-to-device copy;
- the batch is padded up to a bucket and the block tables up to a width bucket (a power of two), and
  attention goes through ``PaddedDecodeBackend``, whose shapes depend only on those two numbers;
- padding rows write their K/V into a scratch block that the scheduler never hands out, and read only it.

Graphs are captured lazily, on the first step that needs a (batch, width) bucket; steps that fit no
bucket (prefill chunks, images, too wide a table) run eagerly. CUDA and a single TP rank only.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from workers.engine.attention import AttentionMetadata, PaddedDecodeBackend
from workers.engine.layers import TPGroup
from workers.engine.models.base import LanguageModel

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_WIDTH = 16  # blocks: shorter tables are padded to this, so short decodes share one graph
# Padded K/V gathered per layer (batch bucket x width x block_size tokens). The gather buffer lives in
# the graph pool (0.5 GiB at this size for 4 KV heads x 128 x bf16); wider steps run eagerly.
MAX_GATHER_TOKENS = 1 << 18


def graphs_wanted(device: torch.device, tp: TPGroup) -> bool:
    """Auto-detection: CUDA, one rank (a graph would have to capture TP collectives), not opted out."""
    if os.environ.get("GLIMPSE_CUDA_GRAPHS", "1") == "0":
        return False
    return device.type == "cuda" and torch.cuda.is_available() and tp.size == 1


def decode_bucket(batch: int, width: int, block_size: int, max_width: int) -> tuple[int, int] | None:
    """(batch bucket, block-table width bucket) of a decode step, or None when it should run eagerly."""
    b = next((x for x in BATCH_BUCKETS if x >= batch), None)
    w = max(MIN_WIDTH, 1 << (width - 1).bit_length())
    if b is None or w > max_width or b * w * block_size > MAX_GATHER_TOKENS:
        return None
    return b, w


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: Tensor  # int64 [B * (6 + W)]: ids, 3 position rows, slots, seq_lens, block table rows
    hidden: Tensor  # [B, hidden]: final-norm hidden states, rewritten by every replay


class DecodeGraphs:
    def __init__(
        self,
        lm: LanguageModel,
        kv_caches: list[Tensor],
        block_size: int,
        scratch_block: int,
        max_blocks_per_seq: int,
    ) -> None:
        self.lm, self.kv_caches, self.block_size = lm, kv_caches, block_size
        self.scratch_block = scratch_block
        self.max_width = max(MIN_WIDTH, 1 << (max_blocks_per_seq - 1).bit_length())
        self.device = kv_caches[0].device
        self.backend = PaddedDecodeBackend()
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.stats = {"replays": 0, "captures": 0, "misses": 0}

    def bucket(self, batch: int, width: int) -> tuple[int, int] | None:
        return decode_bucket(batch, width, self.block_size, self.max_width)

    def run(
        self,
        ids: list[int],
        positions: list[list[int]],
        slots: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
    ) -> Tensor | None:
        """Hidden states [B, hidden] of one decode step (one new token per sequence), or None when the
        step fits no bucket. The result is a view of a static buffer: valid until the next replay."""
        key = self.bucket(len(ids), max(len(t) for t in tables))
        if key is None:
            self.stats["misses"] += 1
            return None
        graph = self.graphs.get(key) or self._capture(*key)
        host = self._pack(key, ids, positions, slots, seq_lens, tables)
        graph.inputs.copy_(host.pin_memory(), non_blocking=True)
        graph.graph.replay()
        self.stats["replays"] += 1
        return graph.hidden[: len(ids)]

    def _pack(
        self,
        key: tuple[int, int],
        ids: list[int],
        positions: list[list[int]],
        slots: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
    ) -> Tensor:
        b, w = key
        pad = b - len(ids)
        scratch = self.scratch_block
        values = [*ids, *[0] * pad]
        for row in positions:
            values += [*row, *[0] * pad]
        values += [*slots, *[scratch * self.block_size] * pad]
        values += [*seq_lens, *[1] * pad]
        for table in tables:
            values += [*table, *[scratch] * (w - len(table))]
        values += [scratch] * (w * pad)
        return torch.tensor(values, dtype=torch.int64)

    def _forward(self, inputs: Tensor, b: int, w: int) -> Tensor:
        ids, pos, slots, seq_lens, table = inputs.split([b, 3 * b, b, b, b * w])
        width = w * self.block_size
        meta = AttentionMetadata(
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=self.device),
            seq_lens=seq_lens,
            query_lens_cpu=[1] * b,
            seq_lens_cpu=[width] * b,  # upper bounds: the padded backend reads only the device lengths
            slot_mapping=slots,
            block_tables=table.view(b, w),
            max_query_len=1,
            max_seq_len=width,
        )
        return self.lm(self.lm.embed_tokens(ids), pos.view(3, b), self.kv_caches, meta, backend=self.backend)

    def _capture(self, b: int, w: int) -> _Graph:
        inputs = self._pack((b, w), [], [[], [], []], [], [], []).to(self.device)  # all padding rows
        # Warm up on a side stream first (lazy library init and workspaces must not happen in capture).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(inputs, b, w)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(inputs, b, w)
        self.graphs[(b, w)] = captured = _Graph(graph, inputs, hidden)
        self.stats["captures"] += 1
        log.info("captured decode graph: batch %d, table width %d blocks", b, w)
        return captured
