"""Start-up work of a CUDA model worker that must happen before it serves: the fused kernels are compiled (or
loaded from Inductor's on-disk cache) by running every call site once, before any CUDA-graph capture, so that
neither the first request nor a capture is a kernel's first launch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from torch import nn

from workers.engine.kernels import (
    autotune_compiles,
    fused,
    gated_delta,
    gated_delta_fla,
    paged_attention,
    skinny_gemm,
    skinny_tune,
)
from workers.engine.kernels.attention import StateMetadata, build_attention_metadata
from workers.engine.kernels.gated_delta_fla import CHUNK as FLA_CHUNK, TUNE_TOKENS
from workers.engine.kernels.launch_helpers import worker_thread
from workers.engine.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from workers.engine.layers.vision_attention import VisionAttention, warm_cudnn_frames
from workers.engine.runner.batching import patches
from workers.engine.runner.kernel_probes import LM, RECURRENT, SKINNY, TOWER, probe_kernels

if TYPE_CHECKING:
    from workers.engine.runner.loaded import LoadedModel

log = logging.getLogger("glimpse.model")


@torch.inference_mode()
def warm_fused(runner: LoadedModel) -> None:
    """Switch the fused kernels on and run every call site. Falls back to eager ops if that fails."""
    started = time.perf_counter()
    autotune_compiles.install()  # fla's autotunes (a hybrid model's) compile their candidates on threads
    probes = [*TOWER, *LM, *(RECURRENT if runner.spec.recurrent is not None else ())]
    skinny_on = probe_kernels(probes, runner.device, runner.dtype)[probes.index(SKINNY)]
    probed = time.perf_counter()
    if skinny_on:
        tune_skinny(runner)  # after the probes: it times GEMMs, which nothing else may share the card with
    tuned = time.perf_counter()
    # (A model worker without its tower, --encoder-workers, compiles nothing of it.)
    towers = [runner.lm] if runner.vision is None else [runner.lm, runner.vision]
    for module in towers:
        fused.enable(module)
    try:
        with fused.forced():
            _run_every_fused_site(runner)
        torch.cuda.synchronize(runner.device)
    except Exception as exc:  # e.g. no C compiler for Triton's launcher: serve eagerly rather than not at all
        for module in towers:
            fused.enable(module, False)
        log.warning("fused kernels unavailable, running eager ops: %s", exc, exc_info=True)
        return
    # the parts, so a cold start's log says where its compiles went
    done = time.perf_counter()
    log.info("fused kernels ready in %.1f s (probes %.1f s, skinny GEMM tiles %.1f s, call sites %.1f s; %s)",
             done - started, probed - started, tuned - probed, done - tuned, autotunes())


def autotunes() -> str:
    """What Triton's autotunes that missed every cache cost this process (kernels/autotune_compiles.py), for a log."""
    s = autotune_compiles.stats
    return (f"{s['tunes']:.0f} autotunes: {s['configs']:.0f} candidates compiled on threads in {s['compile_s']:.1f} s, "
            f"timed in {s['time_s']:.1f} s")


def tune_skinny(runner: LoadedModel) -> None:
    """The skinny GEMM's tile (or cuBLAS) per shape of the LM's projections and head, the weights a decode step
    streams (skinny_tune.py); the fixed rule serves where measuring fails."""
    if not skinny_tune.enabled():
        return
    kinds = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    weights = [m.weight for m in runner.lm.modules() if isinstance(m, kinds) and m.weight.dtype == runner.dtype]
    try:
        skinny_tune.tune(weights, skinny_tune.cache_key(runner.device, runner.dtype),
                         skinny_gemm.sm_count(runner.device))
    except Exception as exc:  # a measurement only picks tiles: serve on the fixed rule rather than not at all
        log.warning("skinny GEMM tiles not measured (%s); the fixed rule serves", exc, exc_info=True)


def _run_every_fused_site(r: LoadedModel) -> None:
    # Three sizes per site: the first compiles static shapes, the second makes the row count symbolic, and 1 (a
    # lone decode) is specialised apart (fused.py). The (1, 6) query also compiles the paged decode kernel.
    # The tower's calls run on a thread beside the LM's: on an empty kernel cache each site's first call is a
    # compile (MLIR, LLVM, ptxas, mostly outside the GIL), and the two models share almost none, so their compiles
    # overlap instead of queueing. Only at TP=1: a rank's two threads must never interleave its collectives.
    beside = r.vision is not None and r.tp.size == 1
    if r.vision is not None and not beside:
        _encode_fused_grids(r)
    with ThreadPoolExecutor(1, thread_name_prefix="warm-tower") as pool:
        tower = pool.submit(_encode_fused_grids, r) if beside else None
        tune_linear_attention(r)  # before the few-token calls below reach fla
        for query, seq in ((2, 2), (3, 5), (1, 6)):
            scratch = [r.num_blocks] * -(-seq // r.cfg.block_size)  # the spare block (ModelRunner.__init__)
            hidden_states = _forward(r, query, seq, scratch)
        # the LM head at a decode step's sampled rows (skinny_gemm's variant for its shape; eager, outside graphs)
        r.model.compute_logits(hidden_states[-1:])
        if tower is not None:
            tower.result()  # its exception, if any, is the warm-up's


def tune_linear_attention(r: LoadedModel) -> None:
    """A hybrid model's first call of fla's chunk kernels, on a prefill of a served chunk's size: fla autotunes each
    kernel once per shape and dtypes, timing whichever call comes first, and configs picked on the warm-up's few
    tokens ran its 8,192-token prefill at half speed (gated_delta_bench on an H200: 1.97 against 1.08 ms at
    Qwen3.5-9B's heads). Where fla's shipped configs cover the shape (fla_tuning.py) this only compiles what the
    warm-up would. Only saves time: a failure is logged and the warm-up goes on."""
    recurrent = r.spec.recurrent
    if recurrent is None or not gated_delta.fla_path(r.device):
        return
    tp = r.tp.size
    try:
        gated_delta_fla.tune_shape(recurrent.num_key_heads // tp, recurrent.num_value_heads // tp,
                                   recurrent.key_head_dim, recurrent.value_head_dim, r.dtype,
                                   tokens=min(r.cfg.chunk_size, TUNE_TOKENS), device=r.device)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - fla then autotunes at its first call, as it would
        log.warning("fla's kernels not tuned on a prefill chunk (%s); they tune at their first call", exc)


def _encode_fused_grids(r: LoadedModel) -> None:
    with worker_thread(r.device):
        for grid in fused_grids(r.merge):
            r.model.encode(torch.zeros(patches(grid), r.spec.patch_dim, dtype=r.dtype, device=r.device), [grid])


def fused_grids(merge: int) -> tuple[tuple[int, int, int], ...]:
    """The three ViT calls that compile a tower's fused sites: static shapes, then symbolic row counts, then the
    smallest image (sides a multiple of the merge, as every family's tower takes them)."""
    return (1, 2 * merge, 2 * merge), (1, 2 * merge, 4 * merge), (1, merge, merge)


def probe_paged_decode(runner: LoadedModel, kv_dtype: torch.dtype) -> None:
    """The Triton paged decode kernel, checked on each KV cache shape of the model before the warm-up and graphs
    pick a decode path: one shape for most families; Gemma 4's sliding layers (the windowed variant) and its global
    layers (512-wide heads, a kernel variant of their own that this card may refuse: those layers then gather)."""
    spec, tp = runner.spec, runner.tp.size
    heads = spec.num_heads // tp
    windows = spec.kv_windows or (0,) * spec.kv_layers
    shapes = spec.kv_shapes or ((spec.num_kv_heads, spec.head_dim),) * spec.kv_layers
    for kv_heads, head_dim, sliding in sorted({(max(1, h // tp), d, w > 0) for (h, d), w in zip(shapes, windows)}):
        paged_attention.probe(runner.device, runner.dtype, heads, kv_heads, head_dim, sliding=sliding,
                              kv_dtype=kv_dtype)


@torch.inference_mode()
def warm_vision_attention(runner: LoadedModel) -> None:
    """The ViT's full-attention kernels' first use, before "ready" (see `warm_cudnn_frames`); nothing without a tower."""
    warm_tower_attention(runner.vision, runner.device, runner.dtype)


def warm_tower_attention(tower: nn.Module | None, device: torch.device, dtype: torch.dtype) -> None:
    """`warm_vision_attention` for a tower on its own (a model worker's or an encoder worker's)."""
    attn = next((m for m in tower.modules() if isinstance(m, VisionAttention)), None) if tower is not None else None
    if attn is None or attn.packed is not None:  # full blocks on FA3: no cuDNN to warm
        return
    started = time.perf_counter()
    try:
        warm_cudnn_frames(attn, device, dtype)
        torch.cuda.synchronize(device)
    except Exception as exc:  # a warm-up only saves time: serve without it rather than not at all
        log.warning("vision attention warm-up failed: %s", exc, exc_info=True)
        return
    log.info("vision attention warmed in %.2f s", time.perf_counter() - started)


# The ViT warm-up's frame: 128 x 128 patches (1,792 px a side at 14 px patches), a large page's size; a call of
# `vit_max_patches` is made of as many as fit (at least one).
_PEAK_FRAME_SIDE = 128
# Shares of the largest ViT call that the warm-up runs, largest first (so smaller activations split blocks the
# allocator already holds).
_LADDER = (1.0, 0.75, 0.5, 0.33, 0.25, 0.125, 0.0625)
# The sizes people send most (screen and camera formats, a square crop, an A4 page at 150 dpi), width x height: the
# ViT runs calls of 1, 2, 3 and as many as fit of each. cuBLAS prepares each GEMM kernel it picks at that kernel's
# first use in a process, 2.2-5.6 ms of host time while the GPU waits (H200, CUDA 13; CUDA's eager module loading
# does not remove it; measured by a since-deleted benchmark, docs/perf-notes.md), and which kernel it picks changes with the row count: a fresh
# server's first 8 x 1080p request paid ~26 ms for the ViT's row counts alone. Other sizes still pay once per new kernel.
COMMON_SIZES: tuple[tuple[int, int], ...] = ((1920, 1080), (1280, 720), (2560, 1440), (3840, 2160), (1024, 1024),
                                             (1240, 1754))
# Prefill chunks run from the step budget down by this factor to a sixteenth of it: a chunk's row count picks the LM's
# GEMM kernels the same way, and a prompt's chunks can have any length. After this ladder (27 chunks from 4,096 down),
# 25 of 100 random row counts in [256, 4096] still met a new kernel in one of the LM's four GEMMs, against 42 of 100
# after a ladder of 7 shares (H200, Qwen2.5-7B shapes; measured by a since-deleted benchmark, docs/perf-notes.md). Each costs once per process.
_CHUNK_STEP = 0.9


def warm_largest_step(runner: LoadedModel) -> None:
    """ViT calls from as many patches as a step hands the tower (`vit_max_patches`) down and at the patch counts of
    `COMMON_SIZES`, and prefill chunks from as many tokens as a step holds down, image rows scattered in, before
    "ready". The caching allocator then holds their activations and the GEMM kernels of their row counts have had
    their first use: a fresh server's first 8 x 1080p request spent ~50 ms more in the ViT and ~25 ms more in the LM
    than the next one (H200). Writes KV into blocks that no sequence holds yet, which each sequence overwrites before
    reading. Only saves time: a failure (out of memory beside an oversized KV cache, say) is logged and serving starts
    without it."""
    started = time.perf_counter()
    try:
        patches_done, tokens = _warm_steps(runner)
        torch.cuda.synchronize(runner.device)
    except Exception as exc:  # torch.OutOfMemoryError included: the first such request will say so itself
        torch.cuda.empty_cache()
        log.warning("the largest-step warm-up failed (%s); the first large request pays its allocations", exc)
        return
    log.info("step shapes warmed in %.2f s (ViT calls of %s patches, prefill chunks of %s tokens)",
             time.perf_counter() - started, patches_done, tokens)


@torch.inference_mode()
def _warm_steps(
    r: LoadedModel, frame_side: int = _PEAK_FRAME_SIDE, sizes: tuple[tuple[int, int], ...] = COMMON_SIZES
) -> tuple[list[int], list[int]]:
    """Run the ViT calls, then the prefill chunks; returns the patches of each ViT call and the tokens of each chunk.
    ``frame_side``: patches a side of the largest ladder frame; ``sizes``: images in pixels (tests take small ones)."""
    calls = vit_calls(r.merge, getattr(r.spec.vision, "patch_size", 0), r.cfg.vit_max_patches, frame_side, sizes)
    # Without a tower (--encoder-workers) no ViT call runs: the chunks still splice image rows, as many as the
    # largest call's entry (zeros, as imported entries would be spliced).
    rows = max(sum(map(patches, grids)) for grids in calls) // r.merge**2 if r.vision is None else 0
    mm_embeds = torch.zeros(rows, r.spec.embed_width, dtype=r.dtype, device=r.device)
    patches_done: list[int] = []
    if r.vision is not None:
        patches_done, mm_embeds = run_vit_calls(r.model.encode, calls, r.spec.patch_dim, r.dtype, r.device)
    longest = max(r.cfg.chunk_size, r.cfg.lone_prefill_tokens)
    longest = min(longest, r.num_blocks * r.cfg.block_size, r.cfg.max_model_len or longest)
    tokens_done = chunk_ladder(longest)
    for tokens in tokens_done:
        _prefill(r, tokens, mm_embeds)
    return patches_done, tokens_done


def vit_calls(
    merge: int, patch: int, vit_max_patches: int, frame_side: int = _PEAK_FRAME_SIDE,
    sizes: tuple[tuple[int, int], ...] = COMMON_SIZES,
) -> list[list[tuple[int, int, int]]]:  # fmt: skip
    """The grids of the ViT calls the warm-up runs: frames of ``frame_side`` patches a side down `_LADDER` from as many
    as a call takes, then 1, 2, 3 and as many as fit of each of ``sizes`` (none where the patch size is unknown)."""
    unit = 2 * merge
    side = max(unit, frame_side // unit * unit)
    most = max(side * side, vit_max_patches // (side * side) * side * side)
    calls = [_frames(int(most * share), side, unit) for share in _LADDER]
    for width, height in sizes if patch else ():
        grid = size_grid(width, height, patch, merge)
        fit = max(1, vit_max_patches // patches(grid))
        calls += [[grid] * k for k in sorted({1, 2, 3, fit}) if k <= fit]
    return calls


def run_vit_calls(
    encode: Callable[[torch.Tensor, list[tuple[int, int, int]]], torch.Tensor],
    calls: list[list[tuple[int, int, int]]], patch_dim: int, dtype: torch.dtype, device: torch.device,
) -> tuple[list[int], torch.Tensor]:  # fmt: skip
    """``encode`` once per distinct patch count of ``calls`` (zero pixels), largest first, so smaller activations split
    blocks the allocator already holds; returns the counts run and the last (smallest) call's output."""
    done: list[int] = []
    out = torch.empty(0, device=device)
    for grids in sorted(calls, key=lambda g: -sum(map(patches, g))):
        n = sum(map(patches, grids))
        if n and n not in done:
            out = encode(torch.zeros(n, patch_dim, dtype=dtype, device=device), grids)
            done.append(n)
    return done, out


def chunk_ladder(longest: int) -> list[int]:
    """Prefill chunk lengths the warm-up runs: ``longest`` down by `_CHUNK_STEP` to a sixteenth of it, largest first."""
    out: list[int] = []
    tokens = float(longest)
    while tokens >= max(1, longest // 16):
        if int(tokens) not in out:
            out.append(int(tokens))
        tokens *= _CHUNK_STEP
    return out


def size_grid(width: int, height: int, patch: int, merge: int) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of a ``width`` x ``height`` image, each side rounded to a multiple of ``patch * merge``
    as Qwen's processors resize it (their pixel bounds do not clip the sizes above)."""
    factor = patch * merge
    return 1, max(factor, round(height / factor) * factor) // patch, max(factor, round(width / factor) * factor) // patch


def _frames(patches: int, side: int, unit: int) -> list[tuple[int, int, int]]:
    """Frames of ``side`` x ``side`` patches up to ``patches``, or one square frame of about that many (sides a multiple
    of ``unit``), empty below one unit square."""
    if patches >= side * side:
        return [(1, side, side)] * (patches // (side * side))
    small = int(patches**0.5) // unit * unit
    return [(1, small, small)] if small else []


@torch.inference_mode()
def warm_state_snapshots(r: LoadedModel) -> list[tuple[int, int, list[int]]]:
    """A hybrid model's prefill chunks that take state snapshots, before "ready": one whose snapshots fall on whole
    fla chunks (the kept-chunk-states path and its one-time check against fla's public function) and one that starts
    inside a block, whose snapshot does not (the rounds path, float32 states between rounds). Each compiles and
    autotunes Triton kernels of its own at first use: on a fresh H200 a Qwen3.5-35B-A3B server under load (64
    concurrent 1080p requests) stalled every stream for 55 s at its first snapshot without this. Writes only the
    scratch slot and blocks no sequence holds yet. Returns (query, seq, snapshot offsets) of each chunk; nothing for
    a model without linear-attention layers. Only saves time: a failure is logged and serving starts without it."""
    if r.state is None:
        return []
    started = time.perf_counter()
    m = -(-max(r.cfg.block_size, FLA_CHUNK) // FLA_CHUNK) * FLA_CHUNK  # a block boundary on a whole chunk (128)
    # (new tokens, KV length after them, snapshot offsets in the chunk): from position 0, cut at whole chunks; then
    # from position 30, so the cut at position m sits 30 tokens short of a whole chunk.
    chunks = [(2 * m + 37, 2 * m + 37, [m, 2 * m, 2 * m + 37]), (m + 50, m + 80, [m - 30, m + 50])]
    fits = [c for c in chunks if c[1] <= min(r.num_blocks * r.cfg.block_size, r.cfg.max_model_len or c[1])]
    try:
        for query, seq, offsets in fits:
            blocks = list(range(-(-seq // r.cfg.block_size)))
            # a later chunk (seq > query) resumes from the state the first one left in the scratch slot
            _forward(r, query, seq, blocks, state=r.state.scratch_metadata(1, seq > query, tuple(offsets)))
        if r.device.type == "cuda":
            torch.cuda.synchronize(r.device)
    except Exception as exc:  # noqa: BLE001 - the first snapshot under load pays the compile instead
        log.warning("the state-snapshot warm-up failed (%s); the first snapshots compile their kernels", exc)
        return []
    log.info("state snapshot paths warmed in %.2f s (%s so far)", time.perf_counter() - started, autotunes())
    return fits


def _prefill(r: LoadedModel, tokens: int, mm_embeds: torch.Tensor) -> None:
    """A prompt's first chunk of ``tokens`` over blocks 0.., its first rows image tokens, and the last row's logits."""
    image_rows = min(tokens, mm_embeds.shape[0])
    mm_rows = torch.arange(image_rows, device=r.device)
    blocks = list(range(-(-tokens // r.cfg.block_size)))
    hidden = _forward(r, tokens, tokens, blocks, mm_rows=mm_rows, mm_embeds=mm_embeds[:image_rows])
    r.model.compute_logits(hidden[-1:])


def _forward(
    r: LoadedModel, query: int, seq: int, blocks: list[int], state: StateMetadata | None = None,
    **images: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The LM over the last ``query`` of ``seq`` tokens (zero embeddings) in ``blocks``; ``images``: mm_rows, mm_embeds;
    ``state``: a hybrid model's (default: from zero in the scratch slot)."""
    meta = build_attention_metadata([query], [seq], [blocks], r.cfg.block_size, r.device)
    if r.state is not None:  # a hybrid model's linear-attention layers run in the scratch slot
        meta.state = state or r.state.scratch_metadata(1)
    if r.num_window_blocks:  # the sliding layers' pool: blocks past it are its scratch block (warm-up reads nothing)
        window = [min(b, r.num_window_blocks) for b in blocks]
        meta.window = build_attention_metadata([query], [seq], [window], r.cfg.block_size, r.device)
    # The embedding's own rows (zeros in, as wide as the LM takes them: Gemma 4's carry per-layer inputs).
    embeds = r.model.embed(torch.zeros(query, dtype=torch.long, device=r.device))
    positions = torch.arange(seq - query, seq, device=r.device).expand(3, -1)
    out: torch.Tensor = r.model(embeds, positions, r.kv_caches, meta, **images)
    return out
