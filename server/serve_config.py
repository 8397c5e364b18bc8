"""`glimpse serve`'s parsed flags -> one frozen ServerConfig: the checkpoint checked and its spec read once, the
device and the cache budgets settled, each flag checked against the others (a bad combination stops start-up with
one line naming the flag)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from server.config import ServerConfig
from server.encoder_flags import check_transport, encoder_devices, landing_mb

if TYPE_CHECKING:
    from workers.engine.models.model_spec import ModelSpec

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


def build_config(args: argparse.Namespace) -> ServerConfig:
    import torch

    from ipc.kv_event_publisher import default_topic
    from ipc.launch import new_launch_id
    from workers.engine.config import EngineConfig, default_host_cache_mb, serving_kv_blocks
    from workers.engine.models import UnsupportedModel, load_spec
    from workers.engine.models.demo_writer import ensure_demo_model
    from workers.engine.models.loader import CheckpointError, check_checkpoint

    if args.encode_token_cost is not None and args.encode_token_cost < 0:
        raise SystemExit(f"glimpse serve: --encode-token-cost must be >= 0, not {args.encode_token_cost}")
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
    if args.vit_plan_cache_mb < 0:
        raise SystemExit("glimpse serve: --vit-plan-cache-mb must be 0 (keep none) or more")
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
        vit_plan_cache_mb=args.vit_plan_cache_mb,
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
        encode_token_cost=(0.0 if args.encode_token_cost is None else args.encode_token_cost),
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


