"""CUDA graphs for small steps that are not pure decode: prefill chunks of up to a few hundred tokens, alone or
beside decodes (a short prompt's first step, the new text of a chat turn, a mixed step under text load).

Such a step costs the host far more than the GPU: ~24 ms of Python and kernel launches for a few hundred tokens on
a 7B against 11-15 ms of GPU work (docs/perf-notes.md, session 22), so a short prompt's first token waited on the
host. A whole-step graph (cuda_graphs.py) needs attention of fixed shapes, which a chunk of any length over any
context is not. So the step is captured in pieces: each stretch between two layers' attention calls is one graph
(the first starts at the input embeddings, the last ends with the final norm), and each layer's attention runs
eagerly between two replays, over the step's real rows and metadata, on whichever backend the model uses (FA3,
FlashAttention-2, SDPA).

A step's rows are padded up to a token bucket. The pieces read and write static buffers: the input embeddings and
positions, each layer's q, k, v (copied out at the end of a piece, and K/V written into the cache there, through a
static slot buffer) and its attention output (read at the start of the next). Padding rows carry stale but finite
values through the pieces; they write their K/V into a scratch slot no sequence holds, the attention never sees
them, so they reach no real row (every other op works row by row), and they are never sampled.

The pieces are captured by running the model's own forward once per bucket with an attention backend that, instead
of attending, copies q, k, v out, ends the current capture and begins the next one: a family needs no split layers,
only a decoder that calls ``backend.forward`` once per layer. Steps with more tokens than the largest bucket run
eagerly. CUDA only (TP included: the pieces capture the all-reduces); elsewhere ``emulate`` runs the same buffers and
splits without graphs, which is how CPU tests check them.

Layers need not be alike (Gemma 4): each attention call is recorded at capture with what it attends with (its cache,
scale, window, whether image rows see their whole span, whether it reads the window pool's tables, whether it has
K/V of its own or reads another layer's), and the static q, k, v and output buffers are kept per head shape. The
capture's placeholder metadata carries empty image spans and a window view (where the worker has a window pool), so
every layer shows its own kind; a replayed layer attends with the step's metadata of that kind.

DeepStack (Qwen3-VL): a step with image tokens adds each image row's feature levels to the stream after the first
decoder layers. For such families every bucket has a second set of pieces, captured with the features as a static
[rows, levels * hidden] buffer over every row (zeros where a row is not an image token, so adding it leaves them
as they are; image rows get the same one add as in the eager forward). Text steps keep the plain pieces: the
DeepStack forward materializes the residual add the plain one defers into the next norm, which rounds differently
in bf16, so a text step's numbers do not depend on whether its family has DeepStack.

Hybrid models (Qwen3.5): a linear-attention layer splits too, around the two calls that read and write its
sequences' state (the causal conv and the gated delta rule, piecewise_split.py's ``mix_linear``), which run eagerly
between two pieces over the real rows, taking the step's state slots, snapshots and sequence bounds as they do
without graphs. Its input projection, gates, gated norm and output projection, and the MLP or experts after it, are
in the pieces.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.models.base import LanguageModel
from workers.engine.models.model_spec import ModelSpec
from workers.engine.runner.piecewise_split import (
    Call,
    Capture,
    LinearCall,
    LinearShape,
    Splitter,
    placeholder_meta,
)

log = logging.getLogger(__name__)

# Token counts a step is padded up to. Below ~512 rows a 7B's GEMMs stream weights rather than compute, so padding
# costs the GPU little there; from 512 to 2,048 the buckets are 128 apart (at most ~25% of padding, ~6% near 2k),
# then 256 apart. Steps above the largest bucket in use run eagerly; which buckets are in use: default_tokens below.
TOKEN_BUCKETS = (8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
                 *range(1152, 2049, 128), *range(2304, 4097, 256))


# The largest step graphed by default. Dense attention-only models: past ~1k tokens a 7B's step hides its host time
# under its GPU time (docs/perf-notes.md). Models with routed experts or recurrent state stay host-bound up to the
# step budget: a 2,048-token prefill step 78.0 -> 37.8 ms in pieces on the Qwen3.5-35B-A3B shape ((b) 8.76 -> 9.58
# req/s), 55.8 -> 37.5 on Gemma 4 26B-A4B's, 38.4 -> 32.4 on Qwen3-VL-30B-A3B's; the dense Qwen3.5-27B loses nothing
# to the padding ((b) 5.76 -> 5.80 req/s; H200).
DENSE_TOKENS = 1024
HOST_BOUND_TOKENS = 4096


def _no_poll() -> None:
    pass


class _PollFailed(Exception):
    """An error of the worker's poll inside a replay, kept apart from the graphs' failures (which turn them off)."""


def default_tokens(spec: ModelSpec) -> int:
    """``--piecewise-graph-tokens`` when none is given: larger for models with routed experts or recurrent state."""
    return HOST_BOUND_TOKENS if spec.num_experts or spec.recurrent is not None else DENSE_TOKENS


def covering_bucket(tokens: int) -> int:
    """The smallest bucket a step of ``tokens`` tokens fits (the largest bucket where none does): buckets above a
    worker's largest step would be captured for nothing."""
    return next((b for b in TOKEN_BUCKETS if b >= tokens), TOKEN_BUCKETS[-1])


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The buckets in use when steps of up to ``max_tokens`` tokens are graphed (those not above it)."""
    return tuple(b for b in TOKEN_BUCKETS if b <= max_tokens)


@dataclass
class _Bucket:
    pieces: list[torch.cuda.CUDAGraph]  # one more than the layers; empty when emulated
    positions: Tensor  # int64 [3, rows]
    hidden: Tensor | None = None  # [rows, hidden]: final-norm hidden states, rewritten by every replay
    ds_pieces: list[torch.cuda.CUDAGraph] | None = None  # the same with DeepStack features (families that have them)
    ds_hidden: Tensor | None = None


class PiecewiseGraphs:
    def __init__(
        self,
        lm: LanguageModel,
        backend: AttentionBackend,
        kv_caches: list[Tensor],
        input_width: int,
        max_tokens: int,
        dtype: torch.dtype,
        tp_size: int = 1,
        scratch_slot: int | None = None,
        emulate: bool = False,
        deepstack_levels: int = 0,
        window_scratch_slot: int | None = None,
    ) -> None:
        """``input_width``: columns of the LM's input rows (hidden, or hidden and per-layer inputs); ``backend``: the
        attention the eager forward uses (the replays run the same). ``scratch_slot``: a cache slot no sequence
        holds; given, the pieces write each layer's new K/V into the cache themselves (padding rows into that slot),
        which takes a kernel launch per layer off the eager part. ``emulate``: no graphs (any device): `run` calls
        the model with the pieces' buffers and splits, for tests. ``deepstack_levels``: the family's DeepStack levels
        (0: none). ``window_scratch_slot``: the window pool's spare slot, for a worker that keeps one (Gemma 4's
        sliding layers read and write its caches through the step's window view)."""
        self.lm, self.backend, self.kv_caches, self.tp_size = lm, backend, kv_caches, tp_size
        self.device, self.dtype = kv_caches[0].device, dtype
        self.emulate = emulate
        self.buckets_in_use = token_buckets(max_tokens)
        self.most = most = self.buckets_in_use[-1] if self.buckets_in_use else 0
        self.embeds = torch.zeros(most, input_width, dtype=dtype, device=self.device)
        # q, k, v and attention output per head shape, made at the first run of a bucket (outside any capture); the
        # same for linear-attention layers' inputs and output per their shape.
        self._buffers: dict[tuple[int, int, int], tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        self._linear: dict[LinearShape, tuple[Tensor, Tensor, Tensor]] = {}
        self._inputs: dict[int, Tensor] = {}  # linear-attention layers' q|k|v or whole input projection, by width
        self.scratch_slot = scratch_slot
        self.slots = torch.full((most,), scratch_slot or 0, dtype=torch.int64, device=self.device)  # cache slot per row
        self.window_scratch_slot = window_scratch_slot
        self.window_slots = torch.full((most if window_scratch_slot is not None else 0,), window_scratch_slot or 0,
                                       dtype=torch.int64, device=self.device)
        # DeepStack: every row is a feature row of the DeepStack pieces (ds_rows); rows [:ds_dirty] may hold the
        # last step's features, zeroed before the next one that takes these pieces.
        self.ds_levels = deepstack_levels
        self.ds_feats = torch.zeros(most if deepstack_levels else 0, deepstack_levels * input_width, dtype=dtype,
                                    device=self.device)
        self.ds_rows = torch.arange(self.ds_feats.shape[0], device=self.device)
        self.ds_dirty = 0
        self.layers: list[Call] = []  # each split call (attention or linear mixing), in order
        self.buckets: dict[int, _Bucket] = {}
        self.broken = False
        self.stats = {"replays": 0, "captures": 0, "misses": 0, "deepstack_replays": 0}
        # Called after each layer's eager attention of a replay: the model worker reports finished steps there
        # (runner/launch_poll.py), as the layers' forward hooks do in an eager step.
        self.poll: Callable[[], None] = _no_poll
        mode: Literal["global", "thread_local"] = "thread_local" if tp_size > 1 else "global"  # see DecodeGraphs
        self.capture_mode = mode
        if not emulate:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)

    def bucket(self, tokens: int) -> int | None:
        return next((b for b in self.buckets_in_use if b >= tokens), None)

    def buffers(self, heads: tuple[int, int, int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The static q, k, v and attention output of this head shape (query heads, KV heads, head dim)."""
        out = self._buffers.get(heads)
        if out is None:
            self._outside_capture(f"head shape {heads}")
            q_heads, kv_heads, head_dim = heads
            q = torch.zeros(self.most, q_heads, head_dim, dtype=self.dtype, device=self.device)
            k = torch.zeros(self.most, kv_heads, head_dim, dtype=self.dtype, device=self.device)
            out = self._buffers[heads] = (q, k, torch.zeros_like(k), torch.zeros_like(q))
        return out

    def linear_buffers(self, shape: LinearShape) -> tuple[Tensor, Tensor, Tensor]:
        """The static decay, write strength and output of linear-attention layers of this shape."""
        out = self._linear.get(shape)
        if out is None:
            self._outside_capture(f"linear-attention shape {shape}")
            _, heads, head_dim, g_dtype, beta_dtype = shape
            out = self._linear[shape] = (
                torch.zeros(self.most, heads, dtype=g_dtype, device=self.device),
                torch.zeros(self.most, heads, dtype=beta_dtype, device=self.device),
                torch.zeros(self.most, heads, head_dim, dtype=self.dtype, device=self.device),
            )
        return out

    def input_buffer(self, width: int) -> Tensor:
        """The static [rows, width] input of linear-attention layers: their input projection's product, which the
        layers' q|k|v are the first columns of, or those columns copied (Splitter.mix_linear)."""
        out = self._inputs.get(width)
        if out is None:
            self._outside_capture(f"linear-attention input of width {width}")
            out = self._inputs[width] = torch.zeros(self.most, width, dtype=self.dtype, device=self.device)
        return out

    def _outside_capture(self, what: str) -> None:
        """Static buffers are made at a bucket's first run, outside any capture: one made inside would live in that
        graph's pool."""
        if not self.emulate and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what} first seen inside a capture")

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every bucket, largest first (smaller ones then reuse the pool's blocks)."""
        for rows in reversed(self.buckets_in_use):
            if rows not in self.buckets:
                self._capture(rows)

    def run(self, embeds: Tensor, positions: Tensor, meta: AttentionMetadata,
            deepstack: tuple[Tensor, Tensor] | None = None) -> Tensor | None:
        """Final-norm hidden states [T, hidden] of the step whose input embeddings [T, hidden] and positions [3, T]
        these are (``deepstack``: its image rows' features, as the LM takes them), or None when it fits no bucket
        (or the graphs failed: the caller runs it eagerly, rewriting the same KV slots). The result is a view of a
        static buffer, valid until the next `run`."""
        n = embeds.shape[0]
        rows = self.bucket(n)
        bucket = self.buckets.get(rows) if rows is not None else None
        if self.emulate and rows is not None and bucket is None:
            bucket = self._bucket(rows)
        with_ds = deepstack is not None
        if (meta.window is not None) != (self.window_scratch_slot is not None):
            raise RuntimeError("a step's window view and the pieces' window pool disagree")
        # No capture mid-serving: `capture_all` took every bucket, with its DeepStack set where the family has one.
        if rows is None or bucket is None or self.broken or (with_ds and not self.ds_levels):
            self.stats["misses"] += 1
            return None
        if deepstack is not None:
            if self.ds_dirty:
                self.ds_feats[: self.ds_dirty].zero_()
            self.ds_feats.index_copy_(0, deepstack[0], deepstack[1])
            self.ds_dirty = n
        self.embeds[:n].copy_(embeds)
        bucket.positions[:, :n].copy_(positions)
        if self.scratch_slot is not None:
            self.slots[:n].copy_(meta.slot_mapping)
            self.slots[n:rows].fill_(self.scratch_slot)
            window = meta.window
            if window is not None and self.window_scratch_slot is not None:
                self.window_slots[:n].copy_(window.slot_mapping)
                self.window_slots[n:rows].fill_(self.window_scratch_slot)
                window = replace(window, kv_written=True, derived={})
            # a copy: a fallback to eager must still write
            meta = replace(meta, kv_written=True, derived={}, window=window)
        self.stats["deepstack_replays"] += with_ds
        if self.emulate:
            # The forward sees the capture's placeholder (every layer shows its kind); the splitter attends with meta.
            shown = placeholder_meta(rows, self.device, self.window_scratch_slot is not None)
            splitter = Splitter(self, rows, real=n, meta=meta, window_meta=shown.window)
            hidden: Tensor = self.lm(self.embeds[:rows], bucket.positions, self.kv_caches, shown, backend=splitter,
                                     deepstack=self._deepstack(rows) if with_ds else None)
            self.stats["replays"] += 1
            return hidden[:n]
        pieces, out = (bucket.ds_pieces, bucket.ds_hidden) if with_ds else (bucket.pieces, bucket.hidden)
        assert pieces is not None and out is not None
        try:
            for layer, piece in enumerate(pieces[:-1]):
                piece.replay()
                self.attend(layer, n, meta)
                self._poll()
            pieces[-1].replay()
        except _PollFailed as failed:  # the worker's own error, not the graphs': it goes up as it came
            assert failed.__cause__ is not None
            raise failed.__cause__ from None
        except RuntimeError:
            if self.tp_size > 1:
                raise  # the other ranks would wait in a captured all-reduce: fail the step instead
            log.exception("piecewise CUDA graphs failed; small steps run eagerly from now on")
            self.broken = True
            return None
        self.stats["replays"] += 1
        return out[:n]

    def _poll(self) -> None:
        try:
            self.poll()
        except Exception as exc:
            raise _PollFailed from exc

    def attend(self, layer: int, n: int, meta: AttentionMetadata) -> None:
        """Layer ``layer``'s split call over the step's ``n`` real rows, into the static output: its attention, with
        the step's metadata of the layer's kind, or its linear-attention mixing over the step's state slots."""
        call = self.layers[layer]
        if isinstance(call, LinearCall):
            g, beta, mixed_out = self.linear_buffers(call.shape)
            mixed = self.input_buffer(call.projection or call.shape[0])[:n, : call.shape[0]]
            call.mixer.mix(mixed, g[:n], beta[:n], meta, out=mixed_out[:n])
            return
        q, k, v, out = self.buffers(call.heads)
        seen = meta.window if call.window_meta and meta.window is not None else meta
        k_n, v_n = (k[:n], v[:n]) if call.own_kv else (None, None)
        out[:n].copy_(self.backend.forward(q[:n], k_n, v_n, call.kv_cache, seen, call.scale, window=call.window,
                                           bidirectional=call.bidirectional))

    def _deepstack(self, rows: int) -> tuple[Tensor, Tensor]:
        """The static DeepStack input of a bucket: every row, its features (zeros for rows that are not images)."""
        return self.ds_rows[:rows], self.ds_feats[:rows]

    def _bucket(self, rows: int) -> _Bucket:
        positions = torch.zeros(3, rows, dtype=torch.int64, device=self.device)
        self.buckets[rows] = bucket = _Bucket([], positions)
        return bucket

    def _capture(self, rows: int) -> None:
        bucket = self._bucket(rows)
        try:
            bucket.pieces, bucket.hidden = self._capture_set(bucket, rows, None)
            if self.ds_levels:
                bucket.ds_pieces, bucket.ds_hidden = self._capture_set(bucket, rows, self._deepstack(rows))
        except BaseException:
            del self.buckets[rows]
            raise

    def _capture_set(self, bucket: _Bucket, rows: int,
                     deepstack: tuple[Tensor, Tensor] | None) -> tuple[list[torch.cuda.CUDAGraph], Tensor]:
        meta = placeholder_meta(rows, self.device, self.window_scratch_slot is not None)
        shown = meta.window
        embeds = self.embeds[:rows]
        # A run outside capture first, on the capture stream: lazy library set-up, compiles and cuBLAS's choice
        # for this row count happen there, not inside the capture.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.lm(embeds, bucket.positions, self.kv_caches, meta, backend=Splitter(self, rows, window_meta=shown),
                    deepstack=deepstack)
        self.stream.synchronize()
        capture = Capture(self.pool, self.capture_mode)
        try:
            with torch.cuda.stream(self.stream):
                capture.begin()
                hidden = self.lm(embeds, bucket.positions, self.kv_caches, meta,
                                 backend=Splitter(self, rows, capture, window_meta=shown), deepstack=deepstack)
                capture.end()
        except BaseException:
            if capture.open:  # leave the stream out of capture mode whatever failed
                try:
                    capture.end()
                except RuntimeError:
                    pass
            raise
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if len(capture.graphs) != len(self.layers) + 1:
            raise RuntimeError(f"{len(capture.graphs)} pieces captured for {len(self.layers)} split calls")
        self.stats["captures"] += len(capture.graphs)
        return capture.graphs, hidden


def build(
    lm: LanguageModel, backend: AttentionBackend, kv_caches: list[Tensor], input_width: int, max_tokens: int,
    dtype: torch.dtype, tp_size: int, scratch_slot: int | None, deepstack_levels: int = 0,
    window_scratch_slot: int | None = None,
) -> PiecewiseGraphs | None:
    """Every bucket captured at start-up, or None when ``max_tokens`` leaves none. A capture that fails stops the
    worker's start, naming the flag that turns the graphs off: a capture that failed on the device leaves torch's
    CUDA generator marked as capturing, so serving on would fail every sampled request."""
    if not token_buckets(max_tokens):
        return None
    started = time.perf_counter()
    graphs = PiecewiseGraphs(lm, backend, kv_caches, input_width, max_tokens, dtype, tp_size, scratch_slot,
                             deepstack_levels=deepstack_levels, window_scratch_slot=window_scratch_slot)
    try:
        graphs.capture_all()
    except Exception as exc:
        raise RuntimeError(f"piecewise CUDA graphs failed to capture ({exc}); --piecewise-graph-tokens 0 serves "
                           "without them") from exc
    log.info("%d piecewise graphs (%d buckets up to %d tokens) captured in %.1f s", graphs.stats["captures"],
             len(graphs.buckets), graphs.buckets_in_use[-1], time.perf_counter() - started)
    return graphs
