"""Decode attention per layer: the padded gather + FlashAttention path against the in-place Triton kernel.

    python -m benchmarks.kernels.paged_decode_bench
    python -m benchmarks.kernels.paged_decode_bench --sweep   # the Triton kernel's launch settings, per shape
    python -m benchmarks.kernels.paged_decode_bench --splits  # the split plan: programs per SM, tiles per split
    python -m benchmarks.kernels.paged_decode_bench --kv-cache-dtype fp8  # the table over an e4m3 cache
    python -m benchmarks.kernels.paged_decode_bench --served 32768 --block-sizes 16  # as a decode graph replays it
    python -m benchmarks.kernels.paged_decode_bench --heads 32:8 --sweep --block-sizes 128 --shapes 64x2200,32x2200
    python -m benchmarks.kernels.paged_decode_bench --heads 24:4 --head-dim 256 --sweep --block-sizes 128  # Qwen3.5-27B

Qwen2.5-VL-7B shapes by default (28 query heads, 4 KV heads, head_dim 128, 16-token blocks; ``--heads 32:8`` for
Qwen3-VL-8B's), bf16, one layer's call as
the CUDA-graph decode makes it (tables padded to a power-of-two width). Prints ms per call and the
effective bandwidth over the live K/V bytes; the two paths' calls are eager (at small shapes that is the host's launch
rate), the last column the Triton kernel alone timed from a CUDA graph, as decode steps replay it.
"""

from __future__ import annotations

import itertools
import math
from functools import partial

import torch

from benchmarks.args import parser
from benchmarks.engine.vit_bench import cuda_ms
from benchmarks.kernels.rope_bench import graph_us
from workers.engine.kernels import kv_quant, paged_attention
from workers.engine.kernels.attention import AttentionMetadata, build_attention_metadata
from workers.engine.kernels.torch_attention import PaddedDecodeBackend

HQ, HKV, D, BS = 28, 4, 128, 16
SWEEP_SHAPES = [(64, 2900), (32, 2900), (128, 2900), (1, 4000), (8, 20000)]  # (batch, context) rows of --sweep


def decode_case(batch: int, context: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
    """q, a random paged cache and the metadata of ``batch`` decode rows of ``context`` keys each, their tables padded
    to a power-of-two width with a scratch block (as a CUDA-graph bucket holds them); and that width in blocks."""
    blocks = -(-context // block_size)
    width = 1 << (blocks - 1).bit_length()
    num_blocks = batch * blocks + 1
    cache = torch.randn(2, num_blocks, block_size, HKV, D, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks - 1).tolist()
    tables = [perm[i * blocks : (i + 1) * blocks] + [num_blocks - 1] * (width - blocks) for i in range(batch)]
    meta = build_attention_metadata([1] * batch, [context] * batch, tables, block_size, device="cuda")
    return torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16), cache, meta, width


def main(fp8: bool = False) -> None:
    """``fp8``: the cache in e4m3 with per-head scales (--kv-cache-dtype fp8): the gather path dequantizes what it
    gathers, the Triton kernel its tiles."""
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, KV cache {'fp8_e4m3' if fp8 else 'bf16'}")
    print("| batch | context | width (tokens) | gather + FA (ms) | paged Triton (ms) | speed-up | Triton GB/s "
          "| Triton kernel, graph (us) |")
    print("|---|---|---|---|---|---|---|---|")
    for batch, context in ((1, 300), (1, 4000), (1, 20000), (16, 2900), (32, 2900), (64, 2900), (128, 2900)):
        q, cache, meta, width = decode_case(batch, context, BS)
        if fp8:
            scales = torch.full((2, HKV), 0.05, device="cuda")
            cache = torch.stack([kv_quant.quantize(cache[i], scales[i]) for i in (0, 1)])
            kv_quant.attach_scales(cache, scales)
        kernel_args = (q, cache, meta.block_tables, meta.seq_lens, D**-0.5, width * BS)
        meta.block_tables = meta.block_tables.long()
        k, v = torch.randn(2, batch, HKV, D, device="cuda", dtype=torch.bfloat16)
        backend = PaddedDecodeBackend()
        times = []
        for use_kernel in (False, True):
            paged_attention.triton_available.cache_clear()
            paged_attention.os.environ["GLIMPSE_PAGED_ATTENTION"] = "1" if use_kernel else "0"
            meta.derived.clear()
            times.append(cuda_ms(partial(backend.forward, q, k, v, cache, meta, D**-0.5), 50))
        graphed = graph_us(partial(paged_attention.paged_decode, *kernel_args))
        live = 2 * batch * context * HKV * D * cache.element_size()
        print(
            f"| {batch} | {context} | {width * BS} | {times[0]:.3f} | {times[1]:.3f} | {times[0] / times[1]:.1f}x "
            f"| {live / times[1] / 1e6:.0f} | {graphed:.1f} |"
        )
    paged_attention.triton_available.cache_clear()
    paged_attention.os.environ.pop("GLIMPSE_PAGED_ATTENTION", None)


def sweep(block_sizes: list[int]) -> None:
    """The split kernel's tile, warps, stages and programs per SM over the decode shapes that matter: the time
    of each setting per call, and its error against the gather path (which must stay at rounding)."""
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per call (one layer), GB/s over live K/V")
    defaults = (paged_attention.TILE, paged_attention._WARPS, paged_attention._STAGES, paged_attention._TARGET_PROGRAMS)
    tiles = (32, 64, 128) if D <= 128 else (16, 32, 64)  # a [64, 256] bf16 tile is already 32 KB
    grid = list(itertools.product(tiles, (2, 4, 8), (2, 3, 4), (1, 2, 4, 8)))
    ratios: dict[tuple[int, ...], list[float]] = {}  # setting -> its time over the default's, per shape
    for bs, (batch, context) in itertools.product(block_sizes, SWEEP_SHAPES):
        q, cache, meta, width = decode_case(batch, context, bs)
        args = (q, cache, meta.block_tables, meta.seq_lens, D**-0.5, width * bs)
        reference = paged_attention.paged_decode(*args).float()
        live = 2 * batch * context * HKV * D * 2
        rows = []
        for tile, warps, stages, target in grid:
            (paged_attention.TILE, paged_attention._WARPS, paged_attention._STAGES,
             paged_attention._TARGET_PROGRAMS) = tile, warps, stages, target
            try:
                out = paged_attention.paged_decode(*args).float()
                ms = cuda_ms(partial(paged_attention.paged_decode, *args), 30)
            except Exception as exc:  # e.g. out of shared memory for a large tile at many stages
                print(f"  bs {bs} tile {tile} warps {warps} stages {stages} x{target}: {type(exc).__name__}")
                continue
            rows.append((ms, tile, warps, stages, target, (out - reference).abs().max().item()))
        (paged_attention.TILE, paged_attention._WARPS, paged_attention._STAGES,
         paged_attention._TARGET_PROGRAMS) = defaults
        now = next(r for r in rows if r[1:5] == defaults)
        for r in rows:
            ratios.setdefault(r[1:5], []).append(r[0] / now[0])
        print(f"block {bs}, batch {batch} x {context}: default {now[0]:.4f} ms ({live / now[0] / 1e6:.0f} GB/s)")
        for ms, tile, warps, stages, target, err in sorted(rows)[:5]:
            print(f"  tile {tile:3} warps {warps} stages {stages} x{target}: {ms:.4f} ms ({live / ms / 1e6:.0f} GB/s, "
                  f"{now[0] / ms:.2f}x), max |d| {err:.1e}")
    shapes = max(len(r) for r in ratios.values())
    print(f"settings over all {shapes} shapes, by the geometric mean of their time over the default's (worst shape)")
    ranked = sorted((math.prod(r) ** (1 / len(r)), max(r), k) for k, r in ratios.items() if len(r) == shapes)
    for mean, worst, (tile, warps, stages, target) in ranked[:12]:
        print(f"  tile {tile:3} warps {warps} stages {stages} x{target}: {mean:.3f} ({worst:.3f})")


def served(width_tokens: int, block_size: int, shapes: list[tuple[int, int]]) -> None:
    """The kernel as a decode step's CUDA graph replays it: one graph per batch bucket covers every width, so the
    tables are padded to the server's whole width (``width_tokens``, its --max-model-len) and the grid is planned
    for it, while the split length is the plan for the step's real width, an input (cuda_graphs.py). Split and
    combine together, graph-timed, us per call."""
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; heads {HQ}:{HKV} x {D}, blocks of "
          f"{block_size}, tables padded to {width_tokens} tokens")
    print("| batch x context | grid splits | live splits | split + combine, graph (us) |")
    print("|---|---|---|---|")
    width = -(-width_tokens // block_size)
    for batch, context in shapes:
        blocks = -(-context // block_size)
        num_blocks = batch * blocks + 1
        cache = torch.randn(2, num_blocks, block_size, HKV, D, device="cuda", dtype=torch.bfloat16)
        perm = torch.randperm(num_blocks - 1).tolist()
        tables = [perm[i * blocks : (i + 1) * blocks] + [num_blocks - 1] * (width - blocks) for i in range(batch)]
        table = torch.tensor(tables, dtype=torch.int64, device="cuda")
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        grid, _ = paged_attention.plan_splits(batch, width * block_size, HKV, table.device)
        per_split = paged_attention.plan_splits(batch, blocks * block_size, HKV, table.device)[1]
        split = torch.tensor([per_split], dtype=torch.int64, device="cuda")
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        call = partial(paged_attention.paged_decode, q, cache, table, lens, D**-0.5, width * block_size, split)
        expected = paged_attention.paged_decode(q, cache, table[:, :blocks], lens, D**-0.5, blocks * block_size)
        assert torch.allclose(call().float(), expected.float(), atol=2e-2, rtol=2e-2)
        print(f"| {batch} x {context} | {grid} | {-(-context // per_split)} | {graph_us(call):.2f} |")


def splits(block_sizes: list[int], rounds: int = 3) -> None:
    """The split plan alone (programs per SM it aims for, a cap on tiles per split) at the kernel's launch settings,
    over short and long contexts; each setting timed ``rounds`` times, interleaved, best kept."""
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per call (one layer), best of {rounds}")
    # (programs per SM aimed at, tiles per split at most, below how many programs per SM that cap applies)
    plans = [(2, 1 << 30, 0), (paged_attention._TARGET_PROGRAMS, paged_attention._MAX_TILES_PER_SPLIT,
             paged_attention._FEW_PROGRAMS), (4, 1 << 30, 0), (8, 1 << 30, 0), (2, 32, 1 << 30), (2, 16, 1 << 30)]
    shapes = ((64, 2900), (32, 2900), (128, 2900), (16, 2900), (1, 4000), (1, 22000), (8, 20000), (16, 20000),
              (32, 20000), (4, 8000))
    defaults = (paged_attention._TARGET_PROGRAMS, paged_attention._MAX_TILES_PER_SPLIT, paged_attention._FEW_PROGRAMS)
    names = ["x2 (before)", "served", "x4", "x8", "x2, cap 32", "x2, cap 16"]
    print("| block | batch x context | " + " | ".join(names) + " |")
    print("|---" * (2 + len(plans)) + "|")
    for bs, (batch, context) in itertools.product(block_sizes, shapes):
        q, cache, meta, width = decode_case(batch, context, bs)
        args = (q, cache, meta.block_tables, meta.seq_lens, D**-0.5, width * bs)
        reference = paged_attention.paged_decode(*args).float()
        best = [float("inf")] * len(plans)
        for _ in range(rounds):
            for i, plan in enumerate(plans):
                (paged_attention._TARGET_PROGRAMS, paged_attention._MAX_TILES_PER_SPLIT,
                 paged_attention._FEW_PROGRAMS) = plan
                err = (paged_attention.paged_decode(*args).float() - reference).abs().max().item()
                assert err < 2e-2, (plan, err)
                best[i] = min(best[i], cuda_ms(partial(paged_attention.paged_decode, *args), 30))
        paged_attention._TARGET_PROGRAMS, paged_attention._MAX_TILES_PER_SPLIT, paged_attention._FEW_PROGRAMS = defaults
        print(f"| {bs} | {batch} x {context} | " + " | ".join(f"{ms:.4f} ({best[0] / ms:.2f}x)" for ms in best) + " |")


if __name__ == "__main__":
    ap = parser(__doc__)
    ap.add_argument("--sweep", action="store_true", help="the Triton kernel's launch settings instead of the table")
    ap.add_argument("--splits", action="store_true", help="the split plan's settings instead of the table")
    ap.add_argument("--block-sizes", default="16,128", help="KV block sizes for --sweep and --splits")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="fp8: the table over an e4m3 cache")
    ap.add_argument("--heads", default="28:4", help="query heads:KV heads (Qwen3-VL-8B: 32:8)")
    ap.add_argument("--shapes", default="", help="--sweep's batch x context rows, e.g. 64x2200,32x2200")
    ap.add_argument("--head-dim", type=int, default=D, help="head dim (Qwen3.5's gated attention: 256)")
    ap.add_argument("--served", type=int, default=0,
                    help="time the kernel as a graph bucket of this many tokens' width replays it (--shapes: its rows)")
    cli = ap.parse_args()
    HQ, HKV = (int(n) for n in cli.heads.split(":"))
    D = cli.head_dim
    if cli.shapes:
        SWEEP_SHAPES[:] = [(int(b), int(c)) for b, c in (x.split("x") for x in cli.shapes.split(","))]
    if cli.kv_cache_dtype == "fp8" and (cli.sweep or cli.splits):
        raise SystemExit("paged_decode_bench: --kv-cache-dtype fp8 applies to the table, not --sweep or --splits")
    if cli.served:
        rows = [(int(b), int(c)) for b, c in (x.split("x") for x in cli.shapes.split(","))] if cli.shapes else [
            (1, 50), (1, 300), (1, 2000), (4, 300), (16, 1000), (64, 2200)]
        served(cli.served, int(cli.block_sizes.split(",")[0]), rows)
    elif cli.sweep:
        sweep([int(b) for b in cli.block_sizes.split(",")])
    elif cli.splits:
        splits([int(b) for b in cli.block_sizes.split(",")])
    else:
        main(cli.kv_cache_dtype == "fp8")
