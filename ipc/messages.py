"""Every message that crosses a process boundary in glimpse, as msgspec Structs.

The engine's scheduling core produces ``StepPlan`` and consumes ``StepResult`` even when it runs
in-process (the offline ``Engine``), so the in-process path and the multi-process path share one
vocabulary. A plan carries pointers (``ShmRef``) and token ids, never pixels: its size depends on
the number of sequences and images in the step, not on how many bytes the images have.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

# Re-exported: every message type is looked up here.
from ipc.logprob_messages import (
    PromptLogprob as PromptLogprob,
    PromptLogprobs as PromptLogprobs,
    SampleLogprobs as SampleLogprobs,
    TokenLogprob as TokenLogprob,
    TopLogprob as TopLogprob,
)
from ipc.shm import ShmRef


class Msg(msgspec.Struct, frozen=True, tag=True, tag_field="kind"):
    """Base of every message that travels alone on a socket: tagged, so a channel decodes a union."""


class StructuredSpec(msgspec.Struct, frozen=True, array_like=True):
    """What a structured output must match, as the request gave it (small: the worker compiles it, and
    caches the compiled grammar under this value)."""

    kind: str  # "json_schema" (value: the schema), "json_object", "regex", "choice" (a JSON list), "lark"
    value: str = ""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Per-request sampling settings (OpenAI's names where they exist). Encoded without the fields left at
    their defaults: every NewSeq of a plan carries one, and most requests set a few fields."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI's penalties subtract from the logits of tokens already generated; repetition_penalty (vLLM's,
    # after transformers) divides a positive logit / multiplies a negative one of tokens in the prompt or output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's log probability and the k best
    # Like logprobs, for every prompt token given the tokens before it (raw logits: no penalty, bias or mask).
    prompt_logprobs: int | None = None
    n: int = 1  # choices: the prompt is computed once, then forked into n sequences (see Fork)
    structured: StructuredSpec | None = None  # tokens are drawn only from what this grammar allows

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the tokens seen so far (prompt and output counts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class MMItem(msgspec.Struct, frozen=True):
    """One image of a request: its identity, where it sits in input_ids and where its pixels are."""

    hash: bytes  # content hash, the image's identity everywhere (cache key, pad values, stats)
    offset: int  # first token of the image's span in input_ids
    length: int  # number of tokens in the span (t * h * w // merge**2)
    grid: tuple[int, int, int]  # (t, h, w) in patches, as the image processor reports it
    pixels: ShmRef | None = None  # None when pixels live in-process (offline Engine)
    # A video's frame group (one temporal patch of frames, its own item: encoded, cached and split across
    # chunks like an image): (its index in the video, its temporal M-RoPE offset). None: an image.
    frame: tuple[int, int] | None = None


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


class StepResult(Msg, frozen=True):
    step_id: int
    sampled: list[tuple[str, int]]  # (rid, token id) for every chunk with sample=True
    images_encoded: int = 0
    vit_calls: int = 0
    logprobs: list[SampleLogprobs] = []  # for the sampled rows whose request asked for them
    prompt_logprobs: list[PromptLogprobs] = []  # for the prefill chunks whose request asked for them


# ---- serving: frontend <-> tokenizer workers <-> scheduler <-> model workers ---------------------
# Each receiving socket decodes one tagged union (see the *Inbound aliases at the end).


class GenerateRequest(Msg, frozen=True):
    """Frontend -> tokenizer: the HTTP body as received; the tokenizer parses it, not the event loop.

    A large body travels as a ZeroMQ frame of its own after the message (``payload_field``, ipc/channels.py), so
    neither end copies it into or out of msgpack, and the tokenizer reads it where ZeroMQ received it (a memoryview
    that keeps the frame alive). Decoded from one frame (a routed request), it is a view into that frame too."""

    payload_field: ClassVar[str] = "body"

    rid: str
    body: memoryview
    arrival: float  # time.time() when the frontend received it
    endpoint: str = "chat"  # which body it is: "chat" (/v1/chat/completions) or "completion" (/v1/completions)


class AbortRequest(Msg, frozen=True):
    """Frontend -> scheduler: the client went away or the server is failing the request. Also
    frontend -> the request's tokenizer while that one has not answered yet: it stops fetching
    and preparing the request, and answers RequestFailed so the frontend frees its slot."""

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
    n: int = 1  # choices: outputs carry their index; the answer ends when all n finished
    endpoint: str = "chat"  # "chat" (/v1/chat/completions) or "completion" (/v1/completions)
    echo: str = ""  # completions with echo: the prompt's text, put before each choice's text
    logprobs: bool = False  # the answer carries logprobs (even where a token has none to report)
    echoes: list[str] = []  # a batch of prompts: each choice's own echo (``echo`` is then unused)
    echo_logprobs: int | None = None  # echo with logprobs: the prompt's tokens lead the logprobs, k best each
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: choices[].prompt_logprobs, k best each
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far on every chunk


class RequestFailed(Msg, frozen=True):
    """Any child -> frontend: the request failed; answer with this OpenAI-shaped error."""

    rid: str
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class TokenizedRequest(Msg, frozen=True):
    """Tokenizer -> scheduler: a ready prompt whose pixels are in shm (items[*].pixels), or on their way there:
    the images named in ``pending`` are still being decoded and written (their names are already fixed), and
    prefill stops short of them until ``MediaReady`` names them."""

    rid: str
    input_ids: list[int]
    mrope_delta: int  # no positions: every model rank derives them from the items' spans and grids
    items: list[MMItem]
    sampling: SamplingParams
    shm_names: list[str]  # segments this request holds a name of; the scheduler unlinks them at the end
    shm_bytes: int
    tool_parser: str = ""  # "hermes": parse <tool_call>{json}</tool_call> blocks of the output into tool calls
    more_prompts: list[list[int]] = []  # a batch of text prompts (completions): choice p answers prompt p
    pending: list[bytes] = []  # hashes of images whose segments are not written yet


class MediaReady(Msg, frozen=True):
    """Tokenizer -> scheduler: these pending images of ``rid`` are written and published under their names."""

    rid: str
    hashes: list[bytes]


class MediaFailed(Msg, frozen=True):
    """Tokenizer -> scheduler: a pending image of ``rid`` failed; the tokenizer stopped writing, unlinked the names
    it never reported ready and answered the frontend. The scheduler drops the request without a word."""

    rid: str


class RouteRequest(Msg, frozen=True):
    """Tokenizer -> frontend with ``--dp`` > 1: a prepared request and what its router scores replicas by (the
    content keys the replica's caches use), sent after RequestAccepted. The frontend forwards ``request``, the
    encoded TokenizedRequest, unchanged to the chosen replica's scheduler."""

    rid: str
    prompt_tokens: int
    blocks: list[bytes]  # prefix-cache keys of the prompt's first full blocks (kv_cache.block_hashes)
    images: list[tuple[bytes, int, int]]  # (content hash, first token, tokens) of each distinct image
    request: msgspec.Raw


class ToolCallDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    """A piece of a tool call parsed from the model's output: the first piece of call ``index`` carries its
    id and function name, later ones more argument text (OpenAI's streamed ``tool_calls`` deltas)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


class RequestOutput(msgspec.Struct, frozen=True):
    """New text of one request since the last output (incremental, UTF-8 safe)."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one entry per token of token_ids, when asked for
    index: int = 0  # the choice (n > 1)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    tool_calls: list[ToolCallDelta] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None  # with the choice's first output, when asked for


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
    gc_collections: int = 0  # the interpreter's garbage collections in this process since it got ready
    gc_pause_s_max: float = 0.0
    gc_frozen: int = 0  # objects moved out of the collector's reach at start-up (workers.common.proc.freeze_heap)
    gc_full: int = 0  # collections of the oldest generation among gc_collections
    gc_pause_s_sum: float = 0.0  # all of them together: time the process's Python stood still


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
    prompt_tokens_computed: int = 0  # prompt tokens run through the LM (prefill work; n > 1 computes a prompt once)
    gpu_peak_bytes: int = 0  # highest step peak over ranks since the engine was last idle
    gpu_idle_bytes: int = 0  # allocated when the engine was last idle (the steady part of the peak)
    replica: int = 0  # which data-parallel replica's scheduler sent it (--dp)
    steps_ahead: int = 0  # steps planned while the step before them ran (asynchronous scheduling)
    samples_dropped: int = 0  # tokens sampled for a sequence that had ended meanwhile (e.g. on the token in flight)
    gc_collections: int = 0  # the scheduler process's garbage collections since it started
    gc_pause_s_max: float = 0.0
    gc_frozen: int = 0
    gc_full: int = 0
    gc_pause_s_sum: float = 0.0


class TokenizerStats(Msg, frozen=True):
    worker: int
    queue_depth: int  # requests this tokenizer is working on (fetching, waiting for or using the CPU)
    requests: int
    images: int
    images_reused: int  # served from a live shm segment: not decoded, processed or written again
    videos: int = 0
    videos_decoded: int = 0  # videos with at least one frame group decoded (the others: every group linked)
    video_frames_decoded: int = 0
    video_groups_reused: int = 0  # frame groups linked from a live shm segment
    images_deferred: int = 0  # fresh images written after their request went to the scheduler (overlap)


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


FrontendInbound = (
    RequestAccepted | RequestFailed | OutputBatch | SchedulerStats | TokenizerStats | ProcessReady | RouteRequest
)
TokenizerInbound = GenerateRequest | AbortRequest | SchedulerStats | Shutdown
SchedulerInbound = (
    TokenizedRequest | MediaReady | MediaFailed | AbortRequest | StepResult | WorkerFailed | WorkerStats
    | ProcessReady | Shutdown
)
ModelInbound = StepPlan | Shutdown
