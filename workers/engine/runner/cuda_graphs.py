"""CUDA graphs for the language model's pure-decode steps.

A decode step launches ~50 kernels per layer (about 1,400 on a 7B) around a few milliseconds of GPU
work, so at decode batch sizes the step is bound by Python and launch latency, not by the GPU.
Replaying a captured graph issues all of them with one call.

A graph fixes shapes and addresses, so:
- each graph reads its inputs from one static int64 buffer, refilled by one host-to-device copy;
- the batch is padded up to a bucket and the block tables up to a width bucket (a power of two), and
  attention goes through ``PaddedDecodeBackend``, whose shapes depend only on those two numbers;
- padding rows write their K/V into a scratch block that the scheduler never hands out, and read only it.

With the Triton paged kernel (the usual case), a graph's table is as wide as the longest sequence allowed
and graphs differ by batch bucket only; they are all captured at start-up. Without it, graphs are captured
lazily, on the first step that needs a (batch, width) bucket. Steps that fit no bucket (prefill chunks,
images, too wide a table) run eagerly. CUDA only; with TP > 1 the all-reduces are captured as well.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from workers.engine.kernels import paged_attention
from workers.engine.kernels.attention import AttentionMetadata, StateMetadata
from workers.engine.kernels.torch_attention import PaddedDecodeBackend
from workers.engine.layers.linear import TPGroup
from workers.engine.models.base import LanguageModel
from workers.engine.runner import piecewise_graphs
from workers.engine.runner.piecewise_graphs import PiecewiseGraphs

if TYPE_CHECKING:
    from workers.engine.runner.loaded import LoadedModel

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_WIDTH = 16  # blocks: shorter tables are padded to this, so short decodes share one graph
# Padded K/V gathered per layer (batch bucket x width x block_size tokens). The gather buffer lives in
# the graph pool (0.5 GiB at this size for 4 KV heads x 128 x bf16); wider steps run eagerly.
MAX_GATHER_TOKENS = 1 << 18


def graphs_wanted(device: torch.device, tp: TPGroup) -> bool:
    """Auto-detection: CUDA and not opted out. With TP > 1 the graphs capture the NCCL all-reduces too: every
    rank runs the same plan, so all ranks capture and replay the same graphs in the same order."""
    if os.environ.get("GLIMPSE_CUDA_GRAPHS", "1") == "0":
        return False
    return device.type == "cuda" and torch.cuda.is_available()


def start_graphs(r: LoadedModel) -> tuple[DecodeGraphs | None, PiecewiseGraphs | None]:
    """A CUDA model worker's graphs, captured before it serves: the pure-decode ones, then the piecewise ones for
    small eager steps (piecewise_graphs.py; ``EngineConfig.piecewise_graph_tokens``). None for both where a module of
    the model cannot be captured: the worker then serves eagerly."""
    cfg, spec = r.cfg, r.spec
    # A module that says it cannot be captured (Qwen3-VL-MoE's experts outside bf16 run a loop that syncs with the
    # host) is checked here, not tried: a capture that fails on the device leaves torch's CUDA generator marked as
    # capturing, and every sampled request after it would fail.
    held = [type(m).__name__ for m in r.lm.modules() if not getattr(m, "capturable", lambda: True)()]
    if held:
        log.warning("no CUDA graphs: %s cannot be captured with %s; every step runs eagerly", held[0], r.dtype)
        return None, None
    max_blocks = -(-(cfg.max_model_len or spec.max_position_embeddings) // cfg.block_size)
    scratch_state = r.state.scratch if r.state is not None else None
    # A window pool (Gemma 4's sliding layers): its slots and tables are inputs too, its scratch block the padding's.
    pool = WindowPool(spec.kv_windows, r.num_window_blocks) if r.num_window_blocks and spec.kv_windows else None
    decode = DecodeGraphs(r.lm, r.kv_caches, cfg.block_size, r.num_blocks, max_blocks, r.tp.size, scratch_state,
                          pool, r.dtype)
    started = time.perf_counter()
    decode.capture_all(cfg.max_num_seqs)
    if decode.stats["captures"]:
        log.info("%d decode graphs captured in %.1f s", decode.stats["captures"], time.perf_counter() - started)
    width = r.model.embed(torch.zeros(1, dtype=torch.int64, device=r.device)).shape[-1]  # the LM's input rows
    window_scratch = pool.scratch * cfg.block_size if pool is not None else None
    most = cfg.piecewise_graph_tokens
    if most is None:
        most = piecewise_graphs.default_tokens(spec)
    largest_step = max(cfg.chunk_size, cfg.lone_prefill_tokens or cfg.chunk_size)  # the scheduler plans none larger
    most = min(most, piecewise_graphs.covering_bucket(largest_step))
    piecewise = piecewise_graphs.build(r.lm, r.lm.attention_backend(r.device), r.kv_caches, width, most, r.dtype,
                                       r.tp.size, r.num_blocks * cfg.block_size,
                                       deepstack_levels=spec.embed_width // spec.hidden_size - 1,
                                       window_scratch_slot=window_scratch)
    if piecewise is not None:  # replayed layers run no forward hook: the worker's poll runs between the pieces
        piecewise.poll = r.launch_poll
    return decode, piecewise


def decode_bucket(batch: int, width: int, block_size: int, max_width: int) -> tuple[int, int] | None:
    """(batch bucket, block-table width bucket) of a decode step without the Triton kernel (the padded K/V
    is gathered, so its size is capped), or None when it should run eagerly."""
    b = next((x for x in BATCH_BUCKETS if x >= batch), None)
    w = max(MIN_WIDTH, 1 << (width - 1).bit_length())
    if b is None or w > max_width or b * w * block_size > MAX_GATHER_TOKENS:
        return None
    return b, w


@dataclass(frozen=True)
class WindowPool:
    """The sliding-window caches' own block pool (core/window_blocks.py), as the graphs see it."""

    windows: tuple[int, ...]  # each KV cache's window, kv_caches order (0: a global cache)
    scratch: int  # its scratch block (the pool's size): padding rows and released table entries point there


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    # int64 [B * 6 + 1 (+ B: state slots) (+ B: window slots)]: ids, 3 position rows, slots, seq_lens, keys per
    # attention split, then each row's linear-attention state slot and its new token's slot in the window pool.
    inputs: Tensor
    # int64 [B, W]. A step rewrites only its rows' first columns (up to its widest table): attention never
    # uses a column past a row's length (padding rows: length 1, column 0), so what is left there is harmless.
    table: Tensor
    window_table: Tensor | None  # int64 [B, W]: the same for the window pool's tables (same rule)
    hidden: Tensor  # [B, hidden]: final-norm hidden states, rewritten by every replay


class DecodeGraphs:
    def __init__(
        self,
        lm: LanguageModel,
        kv_caches: list[Tensor],
        block_size: int,
        scratch_block: int,
        max_blocks_per_seq: int,
        tp_size: int = 1,
        scratch_state: int | None = None,
        window_pool: WindowPool | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.lm, self.kv_caches, self.block_size = lm, kv_caches, block_size
        self.window_pool = window_pool
        # Hybrid models: each row's linear-attention state slot is one more input (padding rows: the scratch slot).
        self.scratch_state = scratch_state
        # NCCL's watchdog thread queries events while a rank captures; "global" capture mode would fail those
        # calls, so with TP only this thread's calls are checked.
        self.capture_mode: Literal["global", "thread_local"] = "thread_local" if tp_size > 1 else "global"
        self.scratch_block = scratch_block
        self.max_width = max(MIN_WIDTH, 1 << (max_blocks_per_seq - 1).bit_length())
        self.device = kv_caches[0].device
        # The split input is planned for the full-attention caches' KV heads (a windowed layer plans over its
        # window and ignores it; the kernel stretches a split that another head count would leave short).
        windows = window_pool.windows if window_pool is not None else (0,) * len(kv_caches)
        self.num_kv_heads = next((c.shape[-2] for c, w in zip(kv_caches, windows, strict=True) if not w),
                                 kv_caches[0].shape[-2])
        self.backend = PaddedDecodeBackend()
        # With the in-place Triton kernel, the table width costs nothing but its copy, so one graph per batch
        # bucket covers every width (the kernel's split length is an input, not a shape) and all of them can
        # be captured at start-up, instead of mid-serving where a capture (and its Triton compile) stalled a
        # decode step by 0.1-0.75 s (docs/perf-notes.md, session 9).
        # Every cache's heads must take the kernel (Gemma 4's 512-wide ones only where the probe passed them): a
        # graph as wide as the longest sequence would otherwise gather that whole width per layer.
        dims = {c.shape[-1] for c in kv_caches}
        self.paged = paged_attention.triton_available() and all(
            paged_attention.usable(torch.empty(1, 1, d, dtype=dtype or kv_caches[0].dtype, device=self.device))
            for d in dims
        )
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.stats = {"replays": 0, "captures": 0, "misses": 0}

    def bucket(self, batch: int, width: int) -> tuple[int, int] | None:
        if self.paged:
            b = next((x for x in BATCH_BUCKETS if x >= batch), None)
            return None if b is None or width > self.max_width else (b, self.max_width)
        return decode_bucket(batch, width, self.block_size, self.max_width)

    def capture_all(self, max_batch: int) -> None:
        """Capture every batch bucket up to ``max_batch`` now (paged attention only: otherwise the width
        buckets multiply the count, and graphs stay lazy)."""
        if not self.paged:
            return
        for b in BATCH_BUCKETS:
            if (key := self.bucket(b, 1)) is not None and key not in self.graphs:
                self._capture(*key)
            if b >= max_batch:
                break

    def run(
        self,
        ids: list[int],
        positions: list[list[int]],
        slots: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        ids_device: Tensor | None = None,
        state_slots: list[int] | None = None,
        window_slots: list[int] | None = None,
        window_tables: list[list[int]] | None = None,
    ) -> Tensor | None:
        """Hidden states [B, hidden] of one decode step (one new token per sequence), or None when the
        step fits no bucket. The result is a view of a static buffer: valid until the next replay.
        ``ids_device``: the ids, already on the device (a step planned ahead), in place of ``ids``.
        ``window_slots`` / ``window_tables``: the rows' slots and tables in the window pool (with one)."""
        width = max(len(t) for t in tables)
        if window_tables:
            width = max(width, *(len(t) for t in window_tables))
        key = self.bucket(len(ids), width)
        if key is None:
            self.stats["misses"] += 1
            return None
        graph = self.graphs.get(key) or self._capture(*key)
        host = self._pack(key, width, ids, positions, slots, seq_lens, state_slots or [], window_slots or [])
        graph.inputs.copy_(host.pin_memory(), non_blocking=True)
        if ids_device is not None:  # the ids lead the inputs buffer; queued after the copy above, so they win
            graph.inputs[: len(ids)].copy_(ids_device)
        _fill(graph.table, tables, width, self.scratch_block)
        if graph.window_table is not None and self.window_pool is not None:
            _fill(graph.window_table, window_tables or [], width, self.window_pool.scratch)
        graph.graph.replay()
        self.stats["replays"] += 1
        return graph.hidden[: len(ids)]

    def _pack(
        self,
        key: tuple[int, int],
        width: int,
        ids: list[int],
        positions: list[list[int]],
        slots: list[int],
        seq_lens: list[int],
        state_slots: list[int],
        window_slots: list[int],
    ) -> Tensor:
        b, _ = key
        pad = b - len(ids)
        scratch = self.scratch_block
        values = [*ids, *[0] * pad]
        for row in positions:
            values += [*row, *[0] * pad]
        values += [*slots, *[scratch * self.block_size] * pad]
        values += [*seq_lens, *[1] * pad]
        # The kernel's grid is fixed by the bucket's full width; its split length follows this step's widest
        # table, so short sequences still spread over as many programs as the bucket allows.
        values.append(
            paged_attention.plan_splits(b, width * self.block_size, self.num_kv_heads, self.device)[1] if self.paged else 0
        )
        if self.scratch_state is not None:
            values += [*state_slots, *[self.scratch_state] * (b - len(state_slots))]
        if self.window_pool is not None:
            values += [*window_slots, *[self.window_pool.scratch * self.block_size] * (b - len(window_slots))]
        return torch.tensor(values, dtype=torch.int64)

    def _forward(self, inputs: Tensor, table: Tensor, window_table: Tensor | None, b: int, w: int) -> Tensor:
        hybrid, pooled = self.scratch_state is not None, window_table is not None
        ids, pos, slots, seq_lens, split, *rest = inputs.split(
            [b, 3 * b, b, b, 1, *([b] if hybrid else []), *([b] if pooled else [])]
        )
        state = rest[:1] if hybrid else []
        width = w * self.block_size
        meta = AttentionMetadata(
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=self.device),
            seq_lens=seq_lens,
            query_lens_cpu=[1] * b,
            seq_lens_cpu=[width] * b,  # upper bounds: the padded backend reads only the device lengths
            slot_mapping=slots,
            block_tables=table,
            max_query_len=1,
            max_seq_len=width,
        )
        meta.derived["split_tokens"] = split
        if window_table is not None:  # the sliding layers' view: the window pool's slots and tables
            meta.window = replace(meta, slot_mapping=rest[-1], block_tables=window_table, derived={"split_tokens": split})
        if state:
            # Every decoding row has state (a sequence decodes only after its prompt); padding rows decode in the
            # scratch slot, whatever it holds. The host lists give only the batch size to the kernels.
            meta.state = StateMetadata(state[0], [self.scratch_state or 0] * b,
                                       torch.ones(b, dtype=torch.bool, device=self.device), [True] * b)
        return self.lm(self.lm.embed_tokens(ids), pos.view(3, b), self.kv_caches, meta, backend=self.backend)

    def _capture(self, b: int, w: int) -> _Graph:
        inputs = self._pack((b, w), 1, [], [[], [], []], [], [], [], []).to(self.device)  # all padding rows
        table = torch.full((b, w), self.scratch_block, dtype=torch.int64, device=self.device)
        pool = self.window_pool
        window_table = None if pool is None else torch.full_like(table, pool.scratch)
        # Warm up on a side stream first (lazy library init and workspaces must not happen in capture).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(inputs, table, window_table, b, w)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self.capture_mode):
            hidden = self._forward(inputs, table, window_table, b, w)
        self.graphs[(b, w)] = captured = _Graph(graph, inputs, table, window_table, hidden)
        self.stats["captures"] += 1
        log.info("captured decode graph: batch %d, table width %d blocks", b, w)
        return captured


def _fill(static: Tensor, tables: list[list[int]], width: int, scratch: int) -> None:
    """Rows' block tables into a graph's static table (their first ``width`` columns; short tables end in scratch)."""
    rows = torch.tensor([t + [scratch] * (width - len(t)) for t in tables], dtype=torch.int64)
    static[: len(tables), :width].copy_(rows.pin_memory(), non_blocking=True)
