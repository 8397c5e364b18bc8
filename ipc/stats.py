"""The counters each process reports: model-worker ranks to their scheduler, schedulers and tokenizers to the
frontend, and schedulers to the tokenizers, which read shm pressure from them.
"""

from __future__ import annotations

from ipc.control import Msg


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
    weight_bytes: int = 0  # the model's parameters and buffers on this rank
    vision_weight_bytes: int = 0  # the vision tower's part of them (0: built without it, --encoder-workers)
    vit_graph_replays: int = 0  # ViT calls replayed from a CUDA graph (layers/vit_graphs.py), of vit_calls
    images_ahead: int = 0  # of images_encoded, encoded by a step for a later one (--encode-ahead-tokens)
    nixl_reads: int = 0  # --encoder-transport nixl: landed entries this rank read with NIXL, and their bytes
    nixl_bytes: int = 0
    ahead_waits: int = 0  # steps that waited for encode-ahead's side stream (it was writing an entry they need)
    gc_idle_full: int = 0  # full collections run while the process was idle (not in the gc_ figures above)


class EncoderStats(Msg, frozen=True):
    """Encoder worker -> its scheduler (--encoder-workers), after each batch: cumulative counters."""

    index: int  # launch-wide: replica * encoder_workers + its number in the replica (its number with --shared-encoders)
    jobs: int  # cache entries computed (EncodeDone sent)
    images_encoded: int
    vit_calls: int
    failed: int = 0  # jobs answered with EncodeFailed
    pixel_reads: int = 0
    pixel_bytes: int = 0
    landing_bytes: int = 0  # bytes of embeddings landed (segments and CUDA pool ranges together)
    # CUDA landing pool (ipc/landing.py): its size (0: none, entries land in shared memory), the bytes its live
    # ranges hold now, and how many entries landed in it and in segments.
    landing_pool_bytes: int = 0
    landing_pool_used_bytes: int = 0
    cuda_landings: int = 0
    shm_landings: int = 0
    nixl_landings: int = 0  # --encoder-transport nixl: entries landed in the NIXL-registered pool
    # A shared encoder (--shared-encoders): requests answered with an entry computed for another request (a replica
    # asking for what another had, or two asking in one batch), and the bytes its recent entries hold.
    reused: int = 0
    recent_bytes: int = 0


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
    shm_segments: int  # pixel segments
    shm_bytes: int  # what --shm-budget-mb bounds: pixels in flight and retained, and landing segments
    shm_budget_bytes: int
    steps: int
    shm_retained_segments: int = 0  # kept after their requests ended, for reuse by later turns
    shm_retained_bytes: int = 0
    # --encoder-workers: embeddings an encoder wrote, from its EncodeDone until the scheduler unlinks them (in
    # shm_bytes too)
    shm_landing_segments: int = 0
    shm_landing_bytes: int = 0
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
    gc_idle_full: int = 0
    # Hybrid models: the linear-attention state pool (live states and prefix snapshots; all 0 for other models).
    state_slots_total: int = 0
    state_slots_live: int = 0
    state_snapshots: int = 0  # published snapshots held now
    state_snapshots_taken: int = 0
    state_snapshots_evicted: int = 0
    state_restores: int = 0  # admissions that resumed from a snapshot
    state_restored_tokens: int = 0  # prompt tokens those skipped
    # The embedding cache's host tier (all 0 when it is off): entries the GPU tier evicted, kept in host memory.
    mm_host_cache_budget_bytes: int = 0
    mm_host_cache_bytes: int = 0
    mm_host_cache_entries: int = 0
    mm_host_cache_hits: int = 0  # GPU misses found there
    mm_host_cache_spills: int = 0  # entries copied in from the GPU tier
    mm_host_cache_reloads: int = 0  # entries copied back onto the GPU instead of encoded
    mm_host_cache_evictions: int = 0
    # The prefix cache's host tier (--kv-host-cache-mb; all 0 when it is off): KV blocks the GPU pool recycled.
    kv_host_cache_slots_total: int = 0
    kv_host_cache_slots_used: int = 0
    kv_host_cache_spilled_blocks: int = 0  # copied in from the GPU pool before their blocks were reused
    kv_host_cache_loaded_blocks: int = 0  # copied back onto the GPU for a prompt's prefix instead of recomputed
    kv_host_cache_hit_tokens: int = 0  # prompt tokens those loads spared (also in each request's cached tokens)
    # Sliding-window models (Gemma 4): the sliding layers' own KV block pool (all 0 for other models).
    window_blocks_total: int = 0
    window_blocks_used: int = 0
    window_blocks_released: int = 0  # given back before their sequence ended (fell out of every later window)
    # Encoder workers (--encoder-workers): each one's latest counters (empty without them).
    encoders: list[EncoderStats] = []


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
