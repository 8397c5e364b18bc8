"""The scheduler <-> model-worker hop: the step plan every TP rank runs and the result rank 0 sends back.

The engine's scheduling core produces ``StepPlan`` and consumes ``StepResult`` even when it runs in-process (the
offline ``Engine``), so the in-process path and the multi-process path share one vocabulary. A plan carries
pointers (``ShmRef``) and token ids, never pixels: its size depends on the number of sequences and images in the
step, not on how many bytes the images have. ``WorkerFailed`` is a rank's answer when a step raised.
"""

from __future__ import annotations

import msgspec

from ipc.control import Msg
from ipc.landing import LandingRef
from ipc.logprob_messages import PromptLogprobs, SampleLogprobs
from ipc.prompts import MMItem, SamplingParams
from ipc.shm import ShmRef


class NewSeq(msgspec.Struct, frozen=True):
    """Everything a model worker needs to know about a sequence, sent once when it is first scheduled."""

    rid: str
    input_ids: list[int]
    # No M-RoPE positions: each rank derives them from the items' spans and grids (mrope_positions),
    # which keeps a first plan at a quarter of the bytes. Decoded tokens sit at p + mrope_delta.
    mrope_delta: int
    items: list[MMItem]
    sampling: SamplingParams
    mm_key: bytes = b""  # baseline mode only: the combined hash of all the request's images
    # After a preemption input_ids is prompt + tokens generated so far: the last num_output of them are output
    # (presence/frequency penalties and min_tokens count only those).
    num_output: int = 0
    # Hybrid models: its live slot in the linear-attention layers' state pools (-1: the model keeps no state).
    state_slot: int = -1


class SeqChunk(msgspec.Struct, frozen=True, omit_defaults=True):
    """The slice of one sequence computed in a step: tokens [start, start + length)."""

    rid: str
    start: int
    length: int
    new_blocks: list[int]  # KV blocks appended to the sequence's block_table since the last step
    new_token_ids: list[int]  # tokens appended to the sequence since the worker last saw it (sampled ones)
    sample: bool  # sample a token after this chunk (last prefill chunk, or decode)
    # Families with sliding-window layers: entries appended to the sequence's window table (the sliding layers' own
    # block pool) since the last step; -1 for a block it does not hold (before a prefix hit's window). Omitted when
    # empty, so other families' chunks encode as before.
    new_window_blocks: list[int] = []


class EncodeItem(msgspec.Struct, frozen=True):
    hash: bytes
    grid: tuple[int, int, int]
    length: int
    pixels: ShmRef | None = None


class EncodeJob(msgspec.Struct, frozen=True):
    """Embeddings to compute this step and store under ``key``: one image (per-image mode) or all of a
    request's images concatenated (baseline mode). A transient job is dropped after the step: the
    cache could not hold it, so it is used once and recomputed if needed again."""

    key: bytes
    items: list[EncodeItem]
    transient: bool = False


class EmbeddingImport(msgspec.Struct, frozen=True):
    """An entry an encoder worker computed (ipc/encode.py): ``rows`` rows at ``embeddings`` (a landing segment or a
    range of the encoder's CUDA landing pool, ipc/landing.py), copied into the embedding store under ``key``; a
    transient one is dropped after the step, like a transient encode job."""

    key: bytes
    embeddings: LandingRef
    rows: int
    transient: bool = False


class Fork(msgspec.Struct, frozen=True, array_like=True):
    """Choice ``index`` of an n > 1 request starts as a copy of ``parent`` right after the parent's prompt is
    computed (this step): it shares the prompt's full KV blocks, gets its own copy of the partial last one
    (``copy``: source block -> destination block, after this step's forward wrote it), and samples its first
    token from the parent's logits. No second prefill, no second image encode."""

    parent: str
    child: str
    index: int
    block_table: list[int]
    copy: tuple[int, int] | None
    seed: int | None  # the parent's seed + index, as vLLM offsets it, so choices differ under one seed
    # Hybrid models: the choice's own state slot, a copy of the parent's after this step's forward (-1: none).
    state_slot: int = -1
    # Families with sliding-window layers: the choice's window table and its copy of the parent's partial block there.
    window_table: list[int] = []
    window_copy: tuple[int, int] | None = None


class StepPlan(Msg, frozen=True):
    step_id: int
    new_seqs: list[NewSeq]
    chunks: list[SeqChunk]
    evict: list[bytes]  # embedding-store keys to drop before encoding
    encode: list[EncodeJob]
    finished: list[str]  # rids whose worker-side state can be dropped
    sent_at: float = 0.0  # time.monotonic() when the scheduler encoded it (one clock for the whole host)
    forks: list[Fork] = []
    # Asynchronous scheduling: planned while the step before it was still running. A chunk that starts right past
    # the tokens sent so far decodes the token that step is sampling: the worker takes its id from its own samples.
    ahead: bool = False
    # The last ``encode_ahead`` jobs of ``encode`` are for images a later step reads (core/encode_ahead.py): the
    # worker runs them after it has queued this step's forward, on a second CUDA stream that the next step waits for.
    encode_ahead: int = 0
    # Hybrid models' prefix cache on recurrent state. ``state_copies`` (source slot, destination slot) run before the
    # forward: a request whose prefix hit a snapshot starts from a copy of it in its live slot. ``snapshots``
    # (rid, position, slot): the sequence's state after token ``position`` (a block boundary inside this step's
    # chunk) is copied into ``slot``, to be published under that block's prefix key.
    state_copies: list[tuple[int, int]] = []
    snapshots: list[tuple[str, int, int]] = []
    # The embedding cache's host tier (core/mm_host_tier.py), keyed like ``evict``. Every rank applies the lists in
    # this order, the order the index planned them in: ``mm_host_evict`` (frees host room), ``mm_spill`` (GPU entry
    # copied to host memory, then dropped from the GPU store; it reads the entry, so spills run before ``evict``
    # can free its rows), ``evict``, ``mm_reload`` (host entry copied back into the GPU store, then dropped from
    # the host tier; started before ``encode`` and landed before the forward that reads it). Empty by default, so
    # plans without a host tier encode as before.
    mm_host_evict: list[bytes] = []
    mm_spill: list[bytes] = []
    mm_reload: list[bytes] = []
    # Host entries copied with ``mm_reload`` but for this step only (the GPU tier refused them) and kept in the host
    # tier: only model workers without a vision tower (--encoder-workers) get these, where others encode the entry.
    mm_reload_once: list[bytes] = []
    # Host-RAM tier of prefix-cache KV blocks (workers/engine/core/host_kv_index.py). Ordering rule: every rank copies
    # all ``kv_spill`` (device block, host slot) first, then all ``kv_load`` (host slot, device block), then runs the
    # forward: a spilled block is one this step hands out again, so it must be read before anything writes KV, and a
    # loaded block must be in place before attention reads it.
    kv_spill: list[tuple[int, int]] = []
    kv_load: list[tuple[int, int]] = []
    # Encoder workers (--encoder-workers): entries they computed, copied from their landing segments into the store
    # right before ``encode`` (after the evictions and reloads above), in this order. Empty without encoder workers.
    mm_import: list[EmbeddingImport] = []


class StepResult(Msg, frozen=True):
    step_id: int
    sampled: list[tuple[str, int]]  # (rid, token id) for every chunk with sample=True
    images_encoded: int = 0
    vit_calls: int = 0
    logprobs: list[SampleLogprobs] = []  # for the sampled rows whose request asked for them
    prompt_logprobs: list[PromptLogprobs] = []  # for the prefill chunks whose request asked for them


class WorkerFailed(Msg, frozen=True):
    """Model worker -> scheduler: a step raised; the scheduler fails the step's requests."""

    rank: int
    step_id: int
    message: str
