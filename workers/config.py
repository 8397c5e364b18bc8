"""Server configuration: built once from CLI flags in the launcher, frozen, pickled into every child.

It lives in workers/ because it flows down: the launcher (server/) builds it and every worker process reads
it; workers and ipc never import server/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from workers.engine.config import EngineConfig


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    launch_id: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    tokenizer_workers: int = 2
    # Threads per tokenizer preparing a request's fresh images at once; 0: cores / tokenizer_workers.
    tokenizer_threads: int = 0
    # Hand a request to the scheduler as soon as its images' grids are known (from their headers), and decode,
    # process and write its new images while its first chunks run (off with --dp > 1 or --mm-cache-mode request).
    overlap_media: bool = True
    # Plan each step while the one before it runs, so the GPU does not wait for the scheduler between steps
    # (with TP > 1, rank 0 broadcasts its sampled ids to the other ranks on the device).
    async_scheduling: bool = True
    # Limits on client input.
    max_images_per_request: int = 32
    max_image_bytes: int = 20 << 20  # encoded bytes of one image (data URL, download or file)
    max_image_pixels: int = 40_000_000  # decoded width * height, checked before full decode
    # Videos (video_url parts); a frame's width * height is held to max_image_pixels.
    max_videos_per_request: int = 4
    max_video_bytes: int = 256 << 20  # encoded bytes of one video (data URL, download or file)
    max_video_seconds: float = 600.0  # duration of one video, from its packets, checked before decoding
    max_video_frames: int = 2048  # sampled (decoded) frames of one request, all its videos together
    max_body_bytes: int = 256 << 20
    # Log-prob entries one answer may hold (docs/limits.md): per choice, a prompt token echoed is 1, with echo
    # logprobs 1 + k more, with prompt_logprobs 1 + k more; a generated token of an answer that is not streamed
    # 1, with logprobs 1 + k more. At most T + 4L + 80 bytes of JSON each (T, L: the longest token's JSON and
    # byte lengths): 2**18 of them keep one answer of the demo vocabulary under 42 MB (~13 MB typically).
    max_logprob_entries: int = 1 << 18
    media_timeout_s: float = 10.0
    allowed_media_domains: tuple[str, ...] = ()  # empty: any host for http(s) URLs
    allowed_local_media_path: str | None = None  # None: file:// and local paths are refused
    # Shared memory for pixels in flight (scheduler's budget; past it requests get 503).
    shm_budget_bytes: int = 4 << 30
    # Share of that budget kept for images whose requests ended, so a chat's next turn reuses them.
    shm_retain_fraction: float = 0.5
    dist_port: int = 0  # torch.distributed rendezvous store on 127.0.0.1 (the launcher serves it when tp > 1)
    # Child start-up and shutdown.
    ready_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    # Hardening against hostile clients (flags of the "hardening" group).
    # Private addresses image downloads may reach anyway: "*", ADDR, CIDR, ADDR:PORT (default: none).
    allow_private_media_addresses: tuple[str, ...] = ()
    shm_retain_idle_s: float = 300.0  # a retained segment unused this long is unlinked; 0: never
    http_max_connections: int = 2048  # past it the oldest idle connection goes, or the new one gets 503
    http_header_timeout_s: float = 10.0  # from connection (or end of the last response) to complete headers
    http_keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    http_idle_timeout_s: float = 60.0  # no byte of a request body, or no write progress, for this long
    http_max_header_bytes: int = 16 << 10  # request line + headers; past it 431
    # Defaults for sampling fields a request leaves out, keyed by request field (temperature, top_p, top_k,
    # min_p, repetition_penalty, max_tokens): the checkpoint's generation_config.json under
    # --generation-config auto (read once by the launcher), empty under none.
    generation_config: str = "auto"
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # --reasoning-parser (workers/common/reasoning.py PARSERS): chat answers' reasoning apart from their content.
    reasoning_parser: str = ""
    # CORS: origins browsers may call the API from ("*": any); empty: no CORS headers at all.
    allowed_origins: tuple[str, ...] = ()
    # Data parallelism: independent scheduler + model-worker groups (each tp_size GPUs) behind one frontend
    # and tokenizer pool; the frontend's router (server/router.py) picks a replica per request.
    dp_size: int = 1
    dp_routing: str = "affinity"  # "round-robin": replicas in turn, blind to what they hold (the baseline)
    # Split encoders: vision-tower-only processes per replica that encode a request's images as soon as it is admitted,
    # ahead of the chunks that need them, and hand the entries over through shared memory (workers/encoder/). 0: each
    # model worker runs the ViT inside its steps.
    encoder_workers: int = 0
    # --shared-encoders (--dp > 1): encoder_workers processes for the whole launch, each taking requests from every
    # replica's scheduler and answering the one that asked, instead of encoder_workers per replica. A replica that
    # happens to get the image-heavy requests then has every encoder at hand, not only its own share.
    shared_encoders: bool = False
    # CUDA: the GPUs encoder workers run on, taken in turn; empty: encoder j of replica r shares that replica's LM GPU
    # r * tp + j % tp (colocated); shared encoder j sits on replica j % dp's LM GPUs.
    encoder_devices: tuple[int, ...] = ()
    # CUDA: each encoder worker's landing pool on its GPU, in MiB (workers/encoder/cuda_landing.py): entries wait there
    # for their import and reach the model ranks through CUDA IPC; 0 (and the CPU): through /dev/shm, as does an entry
    # that finds the pool full. 4096 holds ~64 Qwen3-VL-8B 1080p entries, <3% of an H100's memory. Off by default until
    # the pool has run on a GPU: the /dev/shm path is the one measured (docs/benchmarks.md "Encoder workers").
    encoder_landing_mb: int = 0
    # How landed entries reach the model ranks: "local" (the CUDA pool above where there is one, else /dev/shm) or
    # "nixl" (a pool of encoder_landing_mb registered with a NIXL agent, read with NIXL transfers: within a host or
    # across hosts; workers/encoder/nixl_landing.py).
    encoder_transport: str = "local"
    # --shared-encoders: host memory (MiB) in which each shared encoder keeps its last entries (workers/encoder/recent.py),
    # so that a replica asking for an image another replica had encoded is answered without a ViT run (each replica's
    # scheduler indexes only its own cache). 1024 holds ~16 Qwen3-VL-8B 1080p entries; 0: none kept. Unused without
    # --shared-encoders, where the replica's own cache already remembers its images.
    encoder_cache_mb: int = 1024
    # KV-cache events in vLLM's format (docs/kv-events.md): every replica's on one ZMQ PUB, "" = off. An endpoint
    # with "*" is bound, any other is connected to (an indexer that binds), as vLLM does.
    kv_events_endpoint: str = ""
    # First frame of every event message; the CLI fills in llm-d's kv@<address>:<port>@<model> when left empty.
    kv_events_topic: str = ""
    kv_events_replay_endpoint: str = ""  # vLLM's replay ROUTER (bound); "" = off
    kv_events_buffer_steps: int = 10_000  # batches kept for replay (vLLM's default)
    kv_events_layout: Literal["map", "array"] = "map"  # vLLM >= 0.24 (maps) or <= 0.23 (arrays)
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int | None:
        return self.engine.max_model_len

    def lm_devices(self, replica: int) -> list[int]:
        """CUDA: the GPUs of replica ``replica``'s model ranks (model worker i runs on cuda:i)."""
        tp = self.engine.tp_size
        return list(range(replica * tp, replica * tp + tp))

    @property
    def encoder_count(self) -> int:
        """Encoder worker processes of the launch: encoder_workers in all when shared, else that many per replica."""
        return self.encoder_workers * (1 if self.shared_encoders else max(1, self.dp_size))

    def replica_encoders(self, replica: int) -> list[int]:
        """The launch-wide indices of the encoders replica ``replica``'s scheduler sends to: its own
        (replica * encoder_workers + j), or every one of the launch with shared encoders."""
        n = self.encoder_workers
        return list(range(n)) if self.shared_encoders else list(range(replica * n, replica * n + n))

    def encoder_replicas(self, index: int) -> list[int]:
        """The replicas whose schedulers encoder ``index`` answers: all of them when shared, else its own."""
        if self.shared_encoders:
            return list(range(max(1, self.dp_size)))
        return [index // max(1, self.encoder_workers)]

    def encoder_device(self, index: int) -> str:
        """The device of encoder worker ``index`` (launch-wide: replica * encoder_workers + j; j when shared)."""
        if not self.engine.device.startswith("cuda"):
            return self.engine.device
        if self.encoder_devices:
            return f"cuda:{self.encoder_devices[index % len(self.encoder_devices)]}"
        tp = self.engine.tp_size
        if self.shared_encoders:  # spread over the replicas first, then over each replica's TP GPUs
            replica, j = index % max(1, self.dp_size), index // max(1, self.dp_size)
        else:
            replica, j = divmod(index, max(1, self.encoder_workers))
        return f"cuda:{replica * tp + j % tp}"

    def encoder_readers(self, index: int) -> list[int]:
        """CUDA: the LM GPUs whose ranks import from encoder ``index``'s landing pool (every replica it answers)."""
        return [d for r in self.encoder_replicas(index) for d in self.lm_devices(r)]
