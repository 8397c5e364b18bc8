"""`glimpse serve`: flags -> one frozen ServerConfig -> the launcher."""

from __future__ import annotations

import argparse
import logging
from dataclasses import MISSING, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.config import ServerConfig
from server.encoder_flags import check_transport, encoder_devices, landing_mb
from workers.common.reasoning_markers import PARSERS
from workers.engine.config import KV_CACHE_DTYPES, EngineConfig

if TYPE_CHECKING:
    from workers.engine.models.model_spec import ModelSpec


def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


MB = 1 << 20


def _whole(value: float) -> float | int:
    """20.0 MB shows as 20 in --help and the README."""
    return int(value) if value == int(value) else value

# Every flag's default is the config field's default: one place to change it.
E = _defaults(EngineConfig)
S = _defaults(ServerConfig)

# Served with an image cap (the offline Engine keeps none): on (b) (Qwen3-VL-8B shape, H200, per token) it cut the
# inter-token p99 197 -> 109 ms (FlashAttention-2) and 176 -> 98 ms (FA4) for 1.4-3.4% of the requests/s.
IMAGE_CAP_DEFAULT = 2048


def default_image_cap(spec: ModelSpec) -> int:
    """``--decode-step-image-tokens`` where not given. Models with routed experts or recurrent state get no cap: their
    prefill steps carry a large fixed cost (the same models get piecewise graphs to 4,096 tokens), so cutting chunks
    at images costs them requests/s, while their inter-token p99 without it is already well under vLLM 0.24's. On
    (b) (H200, one server per host): Qwen3-VL-30B-A3B shape 10.32 -> 11.02 req/s (FA4), inter-token p99 72 -> 125 ms
    against vLLM's 343; Qwen3.5-27B shape 5.36 -> 5.76 and 35B-A3B 6.88 -> 8.76 (FA2), p99 273 and 154 ms against
    vLLM's 837 and 306. Dense attention-only models keep it (Qwen3-VL-8B: p99 176 -> 98 ms, vLLM's 118)."""
    return 0 if spec.num_experts or spec.recurrent is not None else IMAGE_CAP_DEFAULT


def add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model behind an OpenAI-compatible HTTP API",
        description="Serve a Qwen2.5-VL or Qwen3-VL checkpoint (a local Hugging Face directory) behind an OpenAI-compatible "
        "API. With no --model, serves the built-in demo model (random weights: its answers are noise).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model and engine")
    m.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    m.add_argument("--served-model-name", default=None, help="name clients send as `model` (default: dir name)")
    m.add_argument("--tp", type=int, default=E["tp_size"], help="tensor-parallel size: model worker processes, one per GPU")
    m.add_argument("--dp", type=int, default=S["dp_size"],
                   help="data-parallel replicas: scheduler + --tp model workers each (replica r on GPUs r*tp..), one "
                   "frontend and tokenizer pool; requests routed by the prefix blocks and images a replica holds")
    m.add_argument("--dp-routing", default=S["dp_routing"], choices=["affinity", "round-robin"],
                   help="affinity: to the replica holding the request's prefix blocks and images, else the least "
                   "busy; round-robin: replicas in turn (the baseline for comparisons)")
    m.add_argument("--encoder-workers", type=int, default=S["encoder_workers"],
                   help="vision-tower-only processes per replica that encode a request's images as soon as it is "
                   "admitted, ahead of the prefill chunks that need them, and hand the embeddings to the model "
                   "workers (through a CUDA IPC pool on the GPU, else shared memory); 0: the model workers run the ViT "
                   "inside their steps")
    m.add_argument("--shared-encoders", action="store_true",
                   help="with --dp > 1: --encoder-workers N are N processes for the whole server, each encoding for "
                   "every replica, instead of N per replica")
    m.add_argument("--encoder-devices", default="", metavar="LIST",
                   help="CUDA: comma-separated GPU indices the encoder workers run on, taken in turn (empty: "
                   "each replica's encoders share its language model's GPUs)")
    m.add_argument("--encoder-landing-mb", type=int, default=None, metavar="MB",
                   help="CUDA: each encoder worker's landing pool on its GPU, read by the model ranks through CUDA "
                   "IPC; an entry that finds it full goes through shared memory; 0: every entry does (default: on "
                   "encoder GPUs of their own a quarter of the GPU, at most 16384; else 0)")
    m.add_argument("--encoder-transport", choices=["local", "nixl"], default="local",
                   help="how encoder workers' entries reach the model ranks: local (the CUDA landing pool, else shared "
                   "memory) or nixl (a pool of --encoder-landing-mb, default 1024, registered with a NIXL agent and "
                   "read with NIXL transfers; needs the nixl package)")
    m.add_argument("--encoder-cache-mb", type=int, default=S["encoder_cache_mb"], metavar="MB",
                   help="with --shared-encoders: host memory in which each encoder keeps its last embeddings, so that "
                   "an image another replica had encoded is not encoded again; 0: none kept")
    m.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    m.add_argument("--dtype", default=E["dtype"], choices=["auto", "float32", "bfloat16", "float16"])
    m.add_argument("--load-format", default=E["load_format"], choices=["auto", "dummy"], help="dummy: random weights")
    m.add_argument("--attn-backend", default=E["attn_backend"], choices=["auto", "sdpa", "flash", "fa3", "fa4"],
                   help="auto: fa4 (FlashAttention-4, the flash-attn-4 dependency) on a Hopper or Blackwell GPU, "
                   "else flash (torch's FlashAttention-2) on CUDA, else sdpa; fa3: an installed build of vLLM's "
                   "FlashAttention-3 fork, only when asked for; a named backend that cannot serve warns and "
                   "falls back to auto's choice")
    m.add_argument("--chunk-size", type=int, default=E["chunk_size"], help="token budget of one step (chunked prefill)")
    m.add_argument("--lone-prefill-tokens", type=int, default=E["lone_prefill_tokens"],
                   help="token budget of a step when no request is decoding (0: --chunk-size)")
    m.add_argument("--decode-step-image-tokens", type=int, default=None,
                   help="image tokens a step that carries decodes may encode (at least one image; 0: no cap; "
                   f"default: {IMAGE_CAP_DEFAULT}; 0 for MoE and hybrid models)")
    m.add_argument("--encode-ahead-tokens", type=int, default=E["encode_ahead_tokens"],
                   help="image tokens a step may encode for later steps, on a second CUDA stream beside its forward "
                   "(at least one image; 0: off; needs --tp 1 and no --encoder-workers)")
    m.add_argument("--max-num-seqs", type=int, default=E["max_num_seqs"], help="most requests running at once")
    m.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    m.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV cache block (default: 128 on CUDA with --attn-backend auto, fa3 or fa4, "
                   "whole FlashAttention key tiles; else 16)")
    m.add_argument("--kv-cache-mb", type=int, default=None, help="KV cache size (default: 512 MB on CPU, 40%% of free GPU memory)")
    m.add_argument("--kv-cache-dtype", default=E["kv_cache_dtype"], choices=list(KV_CACHE_DTYPES),
                   help="KV cache element type: auto = the model's dtype; fp8 (= fp8_e4m3): e4m3 with per-head scales "
                   "(the checkpoint's k_scale/v_scale, else 1.0), twice the blocks of bf16 in the same memory")
    m.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks of --block-size tokens, or without "
                   "it of 16 tokens (laid out in blocks of 128 where those are the default); overrides --kv-cache-mb")
    m.add_argument("--num-window-blocks", type=int, default=None,
                   help="sliding-window models (Gemma 4): blocks of --block-size tokens in the sliding layers' own KV "
                   "pool (default: 2 x each of --max-num-seqs sequences' window plus a chunk, at most half the cache "
                   "budget)")
    m.add_argument("--mm-cache-mb", type=float, default=E["mm_cache_mb"], help="per-image embedding cache budget")
    m.add_argument("--mm-host-cache-mb", type=float, default=E["mm_host_cache_mb"],
                   help="host tier of the embedding cache, per model worker: pinned host memory that entries the GPU "
                   "cache evicts spill into and later requests reload from instead of re-encoding; 0 = off (default: "
                   "off on the CPU; on CUDA min(8192, 20%% of MemTotal / (dp x tp)) MiB, reserved at start-up: every "
                   "rank holds a copy, and pinned pages cannot be swapped, so most of the RAM stays free)")
    m.add_argument("--mm-cache-mode", default=E["mm_cache_mode"], choices=["image", "request"],
                   help="request: the old per-request cache, every image encoded in the first chunk (baseline)")
    m.add_argument("--kv-host-cache-mb", type=float, default=E["kv_host_cache_mb"],
                   help="host tier of the prefix cache, per model worker: host memory (pinned on CUDA, reserved at "
                   "start-up) that KV blocks the GPU pool recycles are copied into, so a later prompt with that "
                   "prefix loads them back instead of recomputing them; 0 = off. Not for hybrid (linear-attention) "
                   "models or a sliding-window block pool")
    m.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="recompute every prompt instead of reusing KV blocks of earlier requests")
    m.add_argument("--state-slots", type=int, default=None,
                   help="hybrid models (Qwen3.5): slots of the linear-attention state pool, live states and prefix "
                   "snapshots (default: 2 per --max-num-seqs if half the cache budget holds them)")
    m.add_argument("--state-snapshot-every", type=int, default=E["state_snapshot_every"],
                   help="hybrid models: snapshot a prompt's state every N KV blocks for the prefix cache, besides at its "
                   "last full block (0: only there)")
    m.add_argument("--vit-max-patches", type=int, default=E["vit_max_patches"],
                   help="a ViT call takes a step's images up to this many patches (at least one image)")
    m.add_argument("--no-fused-kernels", dest="fused_kernels", action="store_false",
                   help="CUDA: eager PyTorch ops instead of the torch.compile'd norm/rotary/SiLU kernels")
    m.add_argument("--piecewise-graph-tokens", type=int, default=E["piecewise_graph_tokens"],
                   help="CUDA: steps of up to this many tokens that are not pure decode replay CUDA graphs between "
                   "the layers' attention calls (rounded down to a bucket; 0: off; default 1024, 4096 for MoE and "
                   "hybrid models)")
    m.add_argument("--seed", type=int, default=E["seed"])
    m.add_argument("--generation-config", default=S["generation_config"], choices=["auto", "none"],
                   help="auto: the checkpoint's generation_config.json gives the defaults of sampling fields a "
                   "request leaves out (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens), "
                   "as vLLM does; none: glimpse's own defaults")
    m.add_argument("--reasoning-parser", default=S["reasoning_parser"], choices=["", *PARSERS],
                   help="chat answers of thinking models: the text between the reasoning markers goes to "
                   "message.reasoning_content / .reasoning (delta.* when streaming), the rest to content "
                   "(qwen3: Qwen3 / Qwen3.5 / Qwen3.6 <think>...</think>; deepseek_r1: the same markers; gemma4: "
                   "Gemma 4's <|channel>thought...<channel|> special tokens); usage.completion_tokens_details"
                   ".reasoning_tokens counts the reasoning's tokens")
    s = p.add_argument_group("server")
    s.add_argument("--host", default=S["host"])
    s.add_argument("--port", type=int, default=S["port"])
    s.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 and /admin")
    s.add_argument("--allowed-origins", default="", metavar="LIST",
                   help="comma-separated origins browsers may call the API from ('*': any); empty: no CORS")
    s.add_argument("--tokenizer-workers", type=int, default=S["tokenizer_workers"], help="processes that parse requests and images")
    s.add_argument("--tokenizer-threads", type=int, default=S["tokenizer_threads"],
                   help="threads per tokenizer decoding, processing and writing a request's new images at once "
                   "(0: cores / --tokenizer-workers)")
    s.add_argument("--no-overlap-media", dest="overlap_media", action="store_false",
                   help="hand a request on only once all its images are written (default: its prefill starts once "
                   "their sizes are read from their headers, while later images are still decoded and written)")
    s.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="plan each step only once the step before it is back (default: the next step is planned and "
                   "sent while the one before it runs, at any --tp)")
    s.add_argument("--launch-id", default=None, help="names this launch's sockets and shm segments (default: random)")
    s.add_argument("--log-level", default=S["log_level"], choices=["debug", "info", "warning", "error"])
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-images-per-request", type=int, default=S["max_images_per_request"])
    lim.add_argument("--max-image-mb", type=float, default=_whole(S["max_image_bytes"] / MB), help="encoded size cap of one image")
    lim.add_argument("--max-image-pixels", type=int, default=S["max_image_pixels"], help="width*height cap of one image")
    lim.add_argument("--max-videos-per-request", type=int, default=S["max_videos_per_request"])
    lim.add_argument("--max-video-mb", type=float, default=_whole(S["max_video_bytes"] / MB), help="encoded size cap of one video")
    lim.add_argument("--max-video-seconds", type=float, default=S["max_video_seconds"], help="duration cap of one video")
    lim.add_argument("--max-video-frames", type=int, default=S["max_video_frames"],
                     help="sampled (decoded) frames of one request, all its videos together")
    lim.add_argument("--max-body-mb", type=float, default=_whole(S["max_body_bytes"] / MB), help="HTTP request body cap")
    lim.add_argument("--max-logprob-entries", type=int, default=S["max_logprob_entries"],
                     help="log-prob entries (and echoed tokens) one answer may hold; past it: 400 (docs/limits.md)")
    lim.add_argument("--media-timeout", type=float, default=S["media_timeout_s"], help="seconds to fetch one image URL")
    lim.add_argument("--allowed-media-domains", default="", help="comma-separated hosts for http(s) image URLs (empty: any)")
    lim.add_argument("--allowed-local-media-path", default=None, help="directory file:// images may come from (default: none)")
    lim.add_argument("--shm-budget-mb", type=int, default=S["shm_budget_bytes"] // MB, help="pixels in shared memory in flight; past it: 503")
    pool = p.add_argument_group("pool", "serving behind an inference gateway (llm-d / Gateway API Inference Extension)")
    pool.add_argument("--kv-events-endpoint", default=S["kv_events_endpoint"], metavar="ADDR",
                      help="publish KV-cache events in vLLM's format on this ZMQ PUB address, every --dp replica on it "
                      "(tcp://*:PORT binds, tcp://HOST:PORT connects); empty: off (docs/kv-events.md)")
    pool.add_argument("--kv-events-topic", default=S["kv_events_topic"],
                      help="topic frame of every KV-event message; empty: kv@<address>:<port>@<served model name>, "
                      "what llm-d reads (address: --host, or $POD_IP / the hostname's address for a wildcard host)")
    pool.add_argument("--kv-events-replay-endpoint", default=S["kv_events_replay_endpoint"], metavar="ADDR",
                      help="bind vLLM's KV-event replay ROUTER socket here (e.g. tcp://*:5558); empty: off")
    pool.add_argument("--kv-events-buffer-steps", type=int, default=S["kv_events_buffer_steps"], metavar="N",
                      help="KV-event batches kept for replay")
    pool.add_argument("--kv-events-layout", choices=("map", "array"), default=S["kv_events_layout"],
                      help="event encoding: map (vLLM >= 0.24, llm-d-router) or array (vLLM <= 0.23, older indexers)")
    h = p.add_argument_group("hardening", "what hostile clients may cost: downloads, shared memory, HTTP connections")
    h.add_argument("--allow-private-media-addresses", default="", metavar="LIST",
                   help="private addresses image URLs may reach anyway: '*' (all), ADDR, CIDR, ADDR:PORT, [V6]:PORT "
                   "(empty: public addresses only; unspecified and multicast addresses are refused always)")
    h.add_argument("--shm-retain-idle-s", type=float, default=S["shm_retain_idle_s"],
                   help="a segment kept for reuse and unused this long is removed (0: never)")
    h.add_argument("--drain-timeout", type=float, default=S["drain_timeout_s"],
                   help="seconds requests in flight may finish after SIGTERM; then they end with an error")
    h.add_argument("--http-max-connections", type=int, default=S["http_max_connections"],
                   help="open connections; past it the oldest idle one is closed, or the new one gets 503")
    h.add_argument("--http-header-timeout", type=float, default=S["http_header_timeout_s"],
                   help="seconds from a connection (or the end of its last response) to a request's complete headers")
    h.add_argument("--http-keep-alive-timeout", type=float, default=S["http_keep_alive_timeout_s"],
                   help="seconds an idle keep-alive connection stays open")
    h.add_argument("--http-idle-timeout", type=float, default=S["http_idle_timeout_s"],
                   help="seconds without a byte of a request body, or of response progress, before the connection closes")
    h.add_argument("--http-max-header-kb", type=float, default=_whole(S["http_max_header_bytes"] / 1024),
                   help="request line and headers past this size get 431")
    p.set_defaults(handler=run_serve)


def build_config(args: argparse.Namespace) -> ServerConfig:
    import torch

    from ipc.kv_event_publisher import default_topic
    from ipc.launch import new_launch_id
    from workers.engine.config import EngineConfig, default_host_cache_mb, serving_kv_blocks
    from workers.engine.models import UnsupportedModel, load_spec
    from workers.engine.models.demo_writer import ensure_demo_model
    from workers.engine.models.loader import CheckpointError, check_checkpoint

    model = Path(args.model) if args.model else ensure_demo_model()
    if not (model / "config.json").exists():
        raise SystemExit(f"glimpse serve: {model} is not a checkpoint directory (no config.json)")
    if args.tokenizer_threads < 0:
        raise SystemExit("glimpse serve: --tokenizer-threads must be 0 (automatic) or more")
    if args.dp < 1:
        raise SystemExit("glimpse serve: --dp must be 1 or more")
    if args.block_size is not None and args.block_size < 1:
        raise SystemExit("glimpse serve: --block-size must be 1 or more")
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        raise SystemExit("glimpse serve: --kv-events-replay-endpoint needs --kv-events-endpoint")
    if args.kv_events_buffer_steps < 1:
        raise SystemExit("glimpse serve: --kv-events-buffer-steps must be 1 or more")
    if args.encode_ahead_tokens < 0:
        raise SystemExit("glimpse serve: --encode-ahead-tokens must be 0 (off) or more")
    if args.encode_ahead_tokens and (args.tp > 1 or args.encoder_workers):
        raise SystemExit("glimpse serve: --encode-ahead-tokens needs --tp 1 (the ViT's all-gather cannot run on a "
                         "second stream) and no --encoder-workers (they encode ahead already)")
    if args.encoder_workers < 0:
        raise SystemExit("glimpse serve: --encoder-workers must be 0 (off) or more")
    if args.encoder_landing_mb is not None and args.encoder_landing_mb < 0:
        raise SystemExit("glimpse serve: --encoder-landing-mb must be 0 (off) or more")
    check_transport(args.encoder_transport, args.encoder_workers, args.encoder_landing_mb)
    if args.encoder_cache_mb < 0:
        raise SystemExit("glimpse serve: --encoder-cache-mb must be 0 (off) or more")
    if args.encoder_workers and args.mm_cache_mode != "image":
        raise SystemExit("glimpse serve: --encoder-workers needs --mm-cache-mode image (the per-image cache)")
    if args.shared_encoders and not args.encoder_workers:
        raise SystemExit("glimpse serve: --shared-encoders needs --encoder-workers 1 or more (the encoders to share)")
    if args.shared_encoders and args.dp < 2:
        raise SystemExit("glimpse serve: --shared-encoders needs --dp 2 or more (replicas to share encoders between)")
    try:
        info = load_spec(model)  # the one read of config.json: children get the parsed spec
        if args.load_format != "dummy":
            check_checkpoint(model)
    except (UnsupportedModel, CheckpointError) as exc:
        raise SystemExit(f"glimpse serve: {exc}") from None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and args.dp * args.tp > torch.cuda.device_count():
        raise SystemExit(f"glimpse serve: --dp {args.dp} x --tp {args.tp} needs {args.dp * args.tp} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    encoder_gpus = encoder_devices(args.encoder_devices, device, args.encoder_workers, info.family)
    block_size, num_kv_blocks = serving_kv_blocks(device, args.attn_backend, args.block_size, args.num_kv_blocks)
    _, num_window_blocks = serving_kv_blocks(device, args.attn_backend, args.block_size, args.num_window_blocks)
    engine = EngineConfig(
        model=str(model),
        device=device,
        dtype=args.dtype,
        load_format=args.load_format,
        attn_backend=args.attn_backend,
        chunk_size=args.chunk_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len or info.max_position_embeddings,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        num_window_blocks=num_window_blocks,
        kv_cache_mb=args.kv_cache_mb,
        kv_cache_dtype=args.kv_cache_dtype,
        mm_cache_mb=args.mm_cache_mb,
        mm_cache_mode=args.mm_cache_mode,
        mm_host_cache_mb=(default_host_cache_mb(device, args.dp * args.tp) if args.mm_host_cache_mb is None
                          else args.mm_host_cache_mb),
        enable_prefix_caching=args.enable_prefix_caching,
        kv_host_cache_mb=args.kv_host_cache_mb,
        state_slots=args.state_slots,
        state_snapshot_every=args.state_snapshot_every,
        vit_max_patches=args.vit_max_patches,
        lone_prefill_tokens=args.lone_prefill_tokens,
        decode_step_image_tokens=(default_image_cap(info) if args.decode_step_image_tokens is None
                                  else args.decode_step_image_tokens),
        encode_ahead_tokens=args.encode_ahead_tokens,
        fused_kernels=args.fused_kernels,
        piecewise_graph_tokens=args.piecewise_graph_tokens,
        seed=args.seed,
        tp_size=args.tp,
        spec=info,
    )
    if (why := engine.kv_host_cache_refusal(info)) is not None:
        raise SystemExit(f"glimpse serve: {why}")
    name = args.served_model_name or ("glimpse-demo" if args.model is None else model.name)
    return ServerConfig(
        engine=engine,
        launch_id=args.launch_id or new_launch_id(),
        served_model_name=name,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        tokenizer_workers=args.tokenizer_workers,
        tokenizer_threads=args.tokenizer_threads,
        overlap_media=args.overlap_media,
        async_scheduling=args.async_scheduling,
        max_images_per_request=args.max_images_per_request,
        max_image_bytes=int(args.max_image_mb * (1 << 20)),
        max_image_pixels=args.max_image_pixels,
        max_videos_per_request=args.max_videos_per_request,
        max_video_bytes=int(args.max_video_mb * (1 << 20)),
        max_video_seconds=args.max_video_seconds,
        max_video_frames=args.max_video_frames,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        max_logprob_entries=args.max_logprob_entries,
        media_timeout_s=args.media_timeout,
        allowed_media_domains=tuple(d.strip() for d in args.allowed_media_domains.split(",") if d.strip()),
        allowed_local_media_path=args.allowed_local_media_path,
        shm_budget_bytes=args.shm_budget_mb << 20,
        log_level=args.log_level,
        generation_config=args.generation_config,
        sampling_defaults=_sampling_defaults(model, args.generation_config),
        reasoning_parser=args.reasoning_parser,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        drain_timeout_s=args.drain_timeout,
        allow_private_media_addresses=_private_exemptions(args.allow_private_media_addresses),
        shm_retain_idle_s=args.shm_retain_idle_s,
        http_max_connections=args.http_max_connections,
        http_header_timeout_s=args.http_header_timeout,
        http_keep_alive_timeout_s=args.http_keep_alive_timeout,
        http_idle_timeout_s=args.http_idle_timeout,
        http_max_header_bytes=int(args.http_max_header_kb * 1024),
        dp_size=args.dp,
        dp_routing=args.dp_routing,
        encoder_workers=args.encoder_workers,
        shared_encoders=args.shared_encoders,
        encoder_devices=encoder_gpus,
        encoder_landing_mb=landing_mb(args.encoder_landing_mb, encoder_gpus, args.dp * args.tp, args.encoder_transport),
        encoder_transport=args.encoder_transport,
        encoder_cache_mb=args.encoder_cache_mb,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_topic=args.kv_events_topic or (default_topic(args.host, args.port, name) if args.kv_events_endpoint else ""),
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_buffer_steps=args.kv_events_buffer_steps,
        kv_events_layout=args.kv_events_layout,
    )


def _private_exemptions(text: str) -> tuple[str, ...]:
    from workers.tokenizer.media.http_fetch import parse_private_exemptions

    entries = tuple(e.strip() for e in text.split(",") if e.strip())
    try:
        parse_private_exemptions(entries)  # refuse a typo at start-up, not on the first download
    except ValueError as exc:
        raise SystemExit(f"glimpse serve: --allow-private-media-addresses: {exc}") from None
    return entries


def _sampling_defaults(model: Path, mode: str) -> dict[str, float]:
    from workers.tokenizer.requests.sampling import load_generation_defaults

    defaults = load_generation_defaults(model) if mode == "auto" else {}
    if defaults:
        logging.getLogger("glimpse.serve").info(
            "sampling defaults from %s/generation_config.json (--generation-config none turns them off): %s",
            model, ", ".join(f"{k}={v:g}" for k, v in sorted(defaults.items())),
        )
    return defaults


def run_serve(args: argparse.Namespace) -> int:
    from server.launcher import serve

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s"
    )
    return serve(build_config(args))
