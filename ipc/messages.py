"""Every message that crosses a process boundary in glimpse, as msgspec Structs.

The engine's scheduling core produces ``StepPlan`` and consumes ``StepResult`` even when it runs
in-process (the offline ``Engine``), so the in-process path and the multi-process path share one
vocabulary. A plan carries pointers (``ShmRef``) and token ids, never pixels: its size depends on
the number of sequences and images in the step, not on how many bytes the images have.
"""

from __future__ import annotations

import msgspec

from ipc.shm import ShmRef


class Msg(msgspec.Struct, frozen=True, tag=True, tag_field="kind"):
    """Base of every message that travels alone on a socket: tagged, so a channel decodes a union."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling settings (OpenAI's names where they exist)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5


class MMItem(msgspec.Struct, frozen=True):
    """One image of a request: its identity, where it sits in input_ids and where its pixels are."""

    hash: bytes  # content hash, the image's identity everywhere (cache key, pad values, stats)
    offset: int  # first token of the image's span in input_ids
    length: int  # number of tokens in the span (t * h * w // merge**2)
    grid: tuple[int, int, int]  # (t, h, w) in patches, as the image processor reports it
    pixels: ShmRef | None = None  # None when pixels live in-process (offline Engine)


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


class SeqChunk(msgspec.Struct, frozen=True):
    """The slice of one sequence computed in a step: tokens [start, start + length)."""

    rid: str
    start: int
    length: int
    new_blocks: list[int]  # KV blocks appended to the sequence's block_table since the last step
    new_token_ids: list[int]  # tokens appended to the sequence since the worker last saw it (sampled ones)
    sample: bool  # sample a token after this chunk (last prefill chunk, or decode)


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


class StepPlan(Msg, frozen=True):
    step_id: int
    new_seqs: list[NewSeq]
    chunks: list[SeqChunk]
    evict: list[bytes]  # embedding-store keys to drop before encoding
    encode: list[EncodeJob]
    finished: list[str]  # rids whose worker-side state can be dropped
    sent_at: float = 0.0  # time.monotonic() when the scheduler encoded it (one clock for the whole host)


class StepResult(Msg, frozen=True):
    step_id: int
    sampled: list[tuple[str, int]]  # (rid, token id) for every chunk with sample=True
    images_encoded: int = 0
    vit_calls: int = 0


# ---- serving: frontend <-> tokenizer workers <-> scheduler <-> model workers ---------------------
# Each receiving socket decodes one tagged union (see the *Inbound aliases at the end).


class GenerateRequest(Msg, frozen=True):
    """Frontend -> tokenizer: the HTTP body as received; the tokenizer parses it, not the event loop."""

    rid: str
    body: bytes
    arrival: float  # time.time() when the frontend received it


class AbortRequest(Msg, frozen=True):
    """Frontend -> scheduler: the client went away or the server is failing the request."""

    rid: str


class Shutdown(Msg, frozen=True):
    """Launcher -> any child: exit cleanly."""

    reason: str = ""


class RequestAccepted(Msg, frozen=True):
    """Tokenizer -> frontend: the body parsed; how to answer the client."""

    rid: str
    stream: bool
    include_usage: bool
    model: str
    prompt_tokens: int
    worker: int


class RequestFailed(Msg, frozen=True):
    """Any child -> frontend: the request failed; answer with this OpenAI-shaped error."""

    rid: str
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class TokenizedRequest(Msg, frozen=True):
    """Tokenizer -> scheduler: a ready prompt whose pixels are in shm (items[*].pixels)."""

    rid: str
    input_ids: list[int]
    mrope_delta: int  # no positions: every model rank derives them from the items' spans and grids
    items: list[MMItem]
    sampling: SamplingParams
    shm_names: list[str]  # segments this request holds a name of; the scheduler unlinks them at the end
    shm_bytes: int


class RequestOutput(msgspec.Struct, frozen=True):
    """New text of one request since the last output (incremental, UTF-8 safe)."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class OutputBatch(Msg, frozen=True):
    """Scheduler -> frontend: the outputs of one step."""

    outputs: list[RequestOutput]


class WorkerStats(Msg, frozen=True):
    """Model worker rank -> scheduler, after a step in which it read pixels: cumulative counters."""

    rank: int
    pixel_reads: int
    pixel_bytes: int
    images_encoded: int
    vit_calls: int
    steps: int = 0
    broadcast_s_sum: float = 0.0  # scheduler encode -> this rank decoded, summed over steps
    broadcast_s_max: float = 0.0
    gpu_step_peak_bytes: int = 0  # peak allocated during the last step (0 on CPU)
    gpu_allocated_bytes: int = 0  # allocated after it: weights, KV cache, embedding store


class SchedulerStats(Msg, frozen=True):
    """Scheduler -> frontend (periodic) and -> tokenizers (shm pressure)."""

    requests_running: int
    requests_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    generated_tokens: int
    prompt_tokens: int
    mm_cache_entries: int
    mm_cache_bytes: int
    mm_cache_hits: int
    mm_cache_misses: int
    mm_cache_evictions: int
    images_encoded: int
    vit_batches: int
    shm_segments: int
    shm_bytes: int
    shm_budget_bytes: int
    steps: int
    shm_retained_segments: int = 0  # kept after their requests ended, for reuse by later turns
    shm_retained_bytes: int = 0
    plan_bytes_last: int = 0
    plan_bytes_max: int = 0
    workers: list[WorkerStats] = []
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose KV was reused instead of computed
    gpu_peak_bytes: int = 0  # highest step peak over ranks since the engine was last idle
    gpu_idle_bytes: int = 0  # allocated when the engine was last idle (the steady part of the peak)


class TokenizerStats(Msg, frozen=True):
    worker: int
    queue_depth: int
    requests: int
    images: int
    images_reused: int  # served from a live shm segment: not decoded, processed or written again


class ProcessReady(Msg, frozen=True):
    """Child -> launcher: started and ready to serve."""

    role: str
    index: int
    pid: int
    num_kv_blocks: int = 0


class WorkerFailed(Msg, frozen=True):
    """Model worker -> scheduler: a step raised; the scheduler fails the step's requests."""

    rank: int
    step_id: int
    message: str


FrontendInbound = RequestAccepted | RequestFailed | OutputBatch | SchedulerStats | TokenizerStats | ProcessReady
TokenizerInbound = GenerateRequest | SchedulerStats | Shutdown
SchedulerInbound = (
    TokenizedRequest | AbortRequest | StepResult | WorkerFailed | WorkerStats | ProcessReady | Shutdown
)
ModelInbound = StepPlan | Shutdown
