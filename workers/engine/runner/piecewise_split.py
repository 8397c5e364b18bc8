"""What a model's forward sees while piecewise CUDA graphs are captured or emulated (piecewise_graphs.py): a
backend whose every split call (a layer's attention, a linear-attention layer's token mixing over its state) hands
its inputs to static buffers, ends the current graph and begins the next one, and returns a static output that the
replays fill eagerly between two pieces.

Two kinds of split: ``forward`` (the attention backend's own call: q, k, v in, attention out) and ``mix_linear``
(a hybrid model's Gated DeltaNet layer: q|k|v before its causal conv, the decay and write-strength gates in, the
delta rule's output out). Both are recorded per layer at the first capture, with what the replays need to run them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from workers.engine.kernels.attention import AttentionMetadata
from workers.engine.kernels.kv_write_kernel import write_kv_cache


class Capture:
    """Consecutive graph captures on one stream: one graph per piece."""

    def __init__(self, pool: Any, mode: Literal["global", "thread_local"]) -> None:
        self.pool, self.mode = pool, mode
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.open = False

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode=self.mode)
        self.graphs.append(graph)
        self.open = True

    def end(self) -> None:
        self.open = False
        self.graphs[-1].capture_end()


@dataclass(frozen=True)
class AttentionCall:
    """One layer's attention call as captured: what its replays attend with."""

    kv_cache: Tensor
    scale: float
    heads: tuple[int, int, int]  # (query heads, KV heads, head dim): the static buffers it uses
    window: int
    bidirectional: bool
    window_meta: bool  # reads the window pool's tables and slots (meta.window)
    own_kv: bool  # writes K/V of its own (not a KV-shared layer's reader)

    def same(self, other: Call) -> bool:
        return isinstance(other, AttentionCall) and self.kv_cache is other.kv_cache and (
            self.scale, self.heads, self.window, self.bidirectional, self.window_meta, self.own_kv
        ) == (other.scale, other.heads, other.window, other.bidirectional, other.window_meta, other.own_kv)


class LinearMixer(Protocol):
    """A linear-attention layer as the pieces split it (models/qwen3_5/linear_attention.py's GatedDeltaNet)."""

    hv: int  # value heads on this rank
    dv: int  # value head dim

    def mix(
        self, mixed: Tensor, g: Tensor, beta: Tensor, meta: AttentionMetadata, out: Tensor | None = None
    ) -> Tensor: ...


LinearShape = tuple[int, int, int, torch.dtype, torch.dtype]  # (q|k|v width, value heads, head dim, g, beta dtypes)


@dataclass(frozen=True)
class LinearCall:
    """One linear-attention layer's token mixing as captured: the layer whose state the replays read and write."""

    mixer: LinearMixer
    shape: LinearShape
    # The width of the static input projection its q|k|v are the first columns of (the layer's GEMM wrote it there:
    # Splitter.linear_projection), or 0 where q|k|v were copied into a buffer of their own.
    projection: int = 0

    def same(self, other: Call) -> bool:
        return isinstance(other, LinearCall) and self.mixer is other.mixer and (self.shape, self.projection) == (
            other.shape, other.projection)


Call = AttentionCall | LinearCall


class PieceOwner(Protocol):
    """What the splitter reads and writes of the pieces (PiecewiseGraphs)."""

    layers: list[Call]
    scratch_slot: int | None
    slots: Tensor
    window_slots: Tensor

    def buffers(self, heads: tuple[int, int, int]) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...

    def linear_buffers(self, shape: LinearShape) -> tuple[Tensor, Tensor, Tensor]: ...

    def input_buffer(self, width: int) -> Tensor: ...

    def attend(self, layer: int, n: int, meta: AttentionMetadata) -> None: ...


class Splitter:
    """The attention backend the model's forward sees while pieces are captured (or emulated): each split call hands
    its inputs to the static buffers and returns the static output."""

    name = "piecewise"
    honours_kv_written = False  # a captured piece writes K/V at the static slots (``forward``), never the rotary

    def __init__(self, owner: PieceOwner, rows: int, capture: Capture | None = None, real: int = 0,
                 meta: AttentionMetadata | None = None, window_meta: AttentionMetadata | None = None) -> None:
        self.owner, self.rows, self.capture, self.real, self.meta = owner, rows, capture, real, meta
        self.window_meta = window_meta  # the metadata object the sliding layers are handed (None: no window pool)
        self.layer = 0
        self.handed: Tensor | None = None  # the last linear_projection buffer, until its mix_linear

    def forward(
        self, q: Tensor, k: Tensor | None, v: Tensor | None, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
        window: int = 0, bidirectional: bool = False,
    ) -> Tensor:
        o, rows = self.owner, self.rows
        own_kv = k is not None and v is not None
        call = AttentionCall(kv_cache, scale, (q.shape[1], kv_cache.shape[-2], q.shape[2]), window, bidirectional,
                             meta is self.window_meta and meta is not None, own_kv)
        bq, bk, bv, out = o.buffers(call.heads)
        bq[:rows].copy_(q)
        if k is not None and v is not None:
            bk[:rows].copy_(k)
            bv[:rows].copy_(v)
            if o.scratch_slot is not None:  # padding rows write to the scratch slot
                write_kv_cache(bk[:rows], bv[:rows], kv_cache, (o.window_slots if call.window_meta else o.slots)[:rows])
        self._split(call)
        return out[:rows]

    def linear_projection(self, width: int) -> Tensor:
        """The static buffer [rows, width] a linear-attention layer's input projection writes its product into
        (ColumnParallelLinear.forward_into), so that the q|k|v columns it hands to `mix_linear` are read in place.
        Copied instead, those strided columns took a generic copy kernel per layer, most of the 1.14 ms such kernels
        took in the 9B's 45.7 ms 2,048-token prefill step (H200, docs/benchmarks.md)."""
        self.handed = self.owner.input_buffer(width)[: self.rows]
        return self.handed

    def mix_linear(self, mixer: LinearMixer, mixed: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """A linear-attention layer's conv and delta rule: run between two pieces over the real rows, from and into
        the sequences' state slots. Padding rows' outputs are stale but finite, as an attention call's are."""
        rows = self.rows
        handed, self.handed = self.handed, None
        in_place = handed is not None and mixed.data_ptr() == handed.data_ptr() and mixed.stride() == handed.stride()
        projection = handed.shape[1] if handed is not None and in_place else 0
        call = LinearCall(mixer, (mixed.shape[1], mixer.hv, mixer.dv, g.dtype, beta.dtype), projection)
        b_g, b_beta, out = self.owner.linear_buffers(call.shape)
        if not projection:
            self.owner.input_buffer(mixed.shape[1])[:rows].copy_(mixed)
        b_g[:rows].copy_(g)
        b_beta[:rows].copy_(beta)
        self._split(call)
        return out[:rows]

    def _split(self, call: Call) -> None:
        o, layer = self.owner, self.layer
        if layer == len(o.layers):
            o.layers.append(call)
        elif not o.layers[layer].same(call):
            raise RuntimeError(f"layer {layer} splits otherwise than at its first capture")
        self.layer += 1
        if self.capture is not None:
            self.capture.end()
            self.capture.begin()
        elif self.meta is not None:  # emulation: the real rows' split call, here and now
            o.attend(layer, self.real, self.meta)


def placeholder_meta(rows: int, device: torch.device, window: bool = False) -> AttentionMetadata:
    """Metadata for the capture run: the splitter attends with none of it (the replays attend with each step's own),
    but the layers show their kind by it: image spans (empty) and, with a window pool, the sliding layers' view."""
    one = torch.ones(1, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, rows], dtype=torch.int32, device=device), seq_lens=one * rows,
        query_lens_cpu=[rows], seq_lens_cpu=[rows], slot_mapping=torch.zeros(rows, dtype=torch.int64, device=device),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device), max_query_len=rows, max_seq_len=rows,
        bidir_spans=[[]],
    )
    if window:
        meta.window = replace(meta, derived={})
    return meta
