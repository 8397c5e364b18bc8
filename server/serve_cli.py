"""`glimpse serve`: its flags (each default the config field's), made into one frozen ServerConfig by serve_config.py,
handed to the launcher."""

from __future__ import annotations

import argparse
import logging
from dataclasses import MISSING, fields
from typing import Any

from server.config import ServerConfig
from server.serve_config import IMAGE_CAP_DEFAULT, build_config
from workers.common.reasoning_markers import PARSERS
from workers.engine.config import KV_CACHE_DTYPES, EngineConfig


def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


MB = 1 << 20


def _whole(value: float) -> float | int:
    """20.0 MB shows as 20 in --help and the README."""
    return int(value) if value == int(value) else value

# Every flag's default is the config field's default: one place to change it.
E = _defaults(EngineConfig)
S = _defaults(ServerConfig)


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
    m.add_argument("--encode-token-cost", type=float, default=None,
                   help="tokens of a step's budget (--chunk-size) that each image token it encodes costs, in a step "
                   "that carries decodes, so that the ViT and the chunk together stay within it (0: encodes are "
                   "free; default: 0)")
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
    m.add_argument("--vit-plan-cache-mb", type=float, default=E["vit_plan_cache_mb"],
                   help="ViT call plans (rotary and window tables by the call's image sizes) kept on the tower's "
                   "device, least recently used out; 0 = rebuild every call's plan")
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
                   help="CUDA: eager PyTorch ops instead of the fused norm/rotary/SiLU kernels (Triton or torch.compile'd)")
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


def run_serve(args: argparse.Namespace) -> int:
    from server.launcher import serve, start_early

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s"
    )
    # their imports overlap the config's build (torch, the checkpoint's checks)
    early = start_early(args.tp, args.dp, args.encoder_workers, args.shared_encoders)
    try:
        return serve(build_config(args), early=early)
    finally:  # those a stopped start never handed their config (a refused flag): killed without a word
        early.close()
