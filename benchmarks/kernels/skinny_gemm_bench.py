"""Decode projections: cuBLAS (F.linear) against the Triton skinny GEMM (workers/engine/kernels/skinny_gemm.py).

    python -m benchmarks.kernels.skinny_gemm_bench [--size 7b] [--rows 1,4,16,32,64] [--sweep 1,32] [--tune]

An LM's projections (Qwen2.5-VL's 7B and 3B, Qwen3-VL-8B, the Qwen3.5-27B side-by-side shape, Gemma 4 26B-A4B's dense
ones) at a decode batch of ``rows``: every layer's qkv, o, gate_up and down (distinct weights per layer, so nothing
is served from L2), and the LM head. Each chain is captured in a CUDA graph and replayed, as the decode step runs,
so launch costs are out and only GPU time is timed. Prints ms per chain and the weights' bandwidth for cuBLAS, the
kernel's own tile choice and (``--sweep``, at the rows given) the best of a grid of tiles, then the whole decode
step's projections summed. With ``--tune`` the "served" column is what the start-up measurement (skinny_tune.py,
on these weights, its choices kept in a scratch file) picks for each matrix.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.args import parser
from workers.engine.kernels import skinny_gemm, skinny_tune
from workers.engine.kernels.skinny_gemm import Tile
from workers.engine.layers import linear as layers


def lm_projections(
    hidden: int, qkv: int, inter: int, depth: int, vocab: int, qkv_bias: bool = True
) -> tuple[tuple[str, int, int, bool, int], ...]:
    """(name, out features, in features, bias, layers) of a Qwen2.5-VL (or Qwen3-VL: no qkv bias) LM's decode
    projections."""
    return (
        ("qkv", qkv, hidden, qkv_bias, depth),
        ("o", hidden, hidden, False, depth),
        ("gate_up", 2 * inter, hidden, False, depth),
        ("down", hidden, inter, False, depth),
        ("lm_head", vocab, hidden, False, 1),
    )


# 7B: hidden 3584, 28 q / 4 kv heads of 128, I 18944; 3B: hidden 2048, 16 q / 2 kv heads of 128, I 11008.
SIZES = {
    "7b": lm_projections(3584, (28 + 2 * 4) * 128, 18944, 28, 152064),
    "3b": lm_projections(2048, (16 + 2 * 2) * 128, 11008, 36, 151936),
    # Qwen3-VL-8B: hidden 4096, 32 q / 8 kv heads of 128, I 12288
    "qwen3-8b": lm_projections(4096, (32 + 2 * 8) * 128, 12288, 36, 151936, qkv_bias=False),
    # Qwen3.5-27B as the side-by-side shape serves it (32 of 64 layers: 24 Gated DeltaNet, 8 gated attention):
    # hidden 5120, I 17408; a DeltaNet layer's fused in_proj (q, k of 16 heads, v and z of 48, b and a of 48) and
    # out_proj from 48 x 128; an attention layer's q (gated: 2 x 24 heads of 256), k and v (4 heads) and o.
    "qwen3.5-27b": (
        ("in_proj", 2 * 16 * 128 + 2 * 48 * 128 + 2 * 48, 5120, False, 24),
        ("out_proj", 5120, 48 * 128, False, 24),
        ("qkv", 2 * 24 * 256 + 2 * 4 * 256, 5120, False, 8),
        ("o", 5120, 24 * 256, False, 8),
        ("gate_up", 2 * 17408, 5120, False, 32),
        ("down", 5120, 17408, False, 32),
        ("lm_head", 248320, 5120, False, 1),
    ),
    # Gemma 4 26B-A4B's dense projections (all under MIN_WEIGHT_BYTES): hidden 2816, dense MLP 2112; sliding layers
    # 16 q / 8 kv heads of 256, global layers (one in 6) 16 q heads and 2 K=V heads of 512; tied head of 262,144.
    "gemma4-26b-a4b": (
        ("qkv", 32 * 256, 2816, False, 25),
        ("o", 2816, 16 * 256, False, 25),
        ("qk_global", 18 * 512, 2816, False, 5),
        ("o_global", 2816, 16 * 512, False, 5),
        ("gate_up", 2 * 2112, 2816, False, 30),
        ("down", 2816, 2112, False, 30),
        ("lm_head", 262144, 2816, False, 1),
    ),
}


def graph_ms(fn: Callable[[], None], reps: int = 20) -> float:
    """GPU ms per call of ``fn`` replayed from a CUDA graph (as the start-up measurement times its candidates)."""
    return skinny_tune.replay_ms(fn, reps, warm=3)


def chain(
    x: Tensor, weights: list[Tensor], bias: Tensor | None, tile: Tile | None | str
) -> Callable[[], None]:
    """``tile``: None for cuBLAS, "served" for what the model's layers pick (layers.linear), else that tile."""

    def run() -> None:
        for w in weights:
            if tile is None:
                F.linear(x, w, bias)
            elif isinstance(tile, Tile):
                skinny_gemm.linear(x, w, bias, use=tile)
            else:
                layers.linear(x, w, bias)

    return run


def sweep_tiles(n: int, k: int) -> list[Tile]:
    out = []
    for block_n in (16, 32, 64, 128):
        for block_k in (64, 128, 256):
            for split in (1, 2, 4, 8):
                if k % (split * block_k) or k // split < 2 * block_k:
                    continue
                for warps, stages in ((4, 4), (4, 3), (4, 6), (8, 4), (2, 4)):
                    out.append(Tile(block_n, block_k, split, warps, stages))
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--size", default="7b", choices=sorted(SIZES))
    ap.add_argument("--rows", default="1,4,16,32,64")
    ap.add_argument(
        "--sweep", default="", help="rows (comma-separated) at which to also time a grid of tiles"
    )
    ap.add_argument("--tune", action="store_true", help="serve each matrix as the start-up measurement picks")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}")
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = SIZES[args.size]
    weights = {
        name: [
            torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) / k**0.5 for _ in range(count)
        ]
        for name, n, k, _, count in shapes
    }
    if args.tune:
        with tempfile.TemporaryDirectory() as scratch:
            picks = skinny_tune.tune([w for ws in weights.values() for w in ws], skinny_tune.cache_key(dev, torch.bfloat16),
                                     sms, path=Path(scratch) / "tiles.json")  # fmt: skip
        print("measured: " + ", ".join(f"{n}x{k} {'cuBLAS' if t is None else tuple(t)}" for (n, k), t in picks.items()))
    biases = {
        name: torch.randn(n, device=dev, dtype=torch.bfloat16) if b else None for name, n, _, b, _ in shapes
    }
    print(
        "| rows | matrix | cuBLAS ms | cuBLAS TB/s | Triton ms | Triton TB/s | tile | best swept ms | best tile "
        "| served ms | max rel diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    totals: dict[int, list[float]] = {}
    runners_up: list[str] = []
    for rows in (int(r) for r in args.rows.split(",")):
        tot = totals.setdefault(rows, [0.0, 0.0, 0.0, 0.0])
        for name, n, k, _, count in shapes:
            xk = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
            ws, b = weights[name], biases[name]
            moved = n * k * 2 * count
            ref = F.linear(xk.float(), ws[0].float(), None if b is None else b.float())
            own = skinny_gemm.tile(n, k, sms)
            diff = ((skinny_gemm.linear(xk, ws[0], b).float() - ref).abs().max() / ref.abs().max()).item()
            cub = graph_ms(chain(xk, ws, b, None))
            tri = graph_ms(chain(xk, ws, b, own))
            best, best_tile = tri, own
            swept: list[tuple[float, Tile]] = []
            if str(rows) in args.sweep.split(","):
                for t in sweep_tiles(n, k):
                    try:
                        swept.append((graph_ms(chain(xk, ws, b, t), reps=10), t))
                    except Exception:  # a tile over the shared-memory limit at this BLOCK_M
                        continue
                swept.sort()
                if swept and swept[0][0] < best:
                    best, best_tile = swept[0]
            tot[0] += cub
            tot[1] += tri
            tot[2] += best
            served = graph_ms(chain(xk, ws, b, "served"))
            tot[3] += served
            print(
                f"| {rows} | {name} x{count} | {cub:.3f} | {moved / cub / 1e9:.2f} | {tri:.3f} | "
                f"{moved / tri / 1e9:.2f} | {tuple(own)} | {best:.3f} | {tuple(best_tile)} | {served:.3f} "
                f"| {diff:.2e} |",
                flush=True,
            )
            if swept:  # the runners-up: how flat the optimum is
                runners_up.append(f"{rows} rows, {name}: " + ", ".join(f"{tuple(t)} {ms:.3f}" for ms, t in swept[1:6]))
    if runners_up:
        print("\nthe next five swept tiles (block_n, block_k, split_k, warps, stages) and their ms:")
        print("\n".join(runners_up))
    print("\n| rows | all projections: cuBLAS ms | Triton ms | best swept ms | served ms |")
    print("|---|---|---|---|---|")
    for rows, (cub_ms, own_ms, best_ms, served_ms) in totals.items():
        print(f"| {rows} | {cub_ms:.3f} | {own_ms:.3f} | {best_ms:.3f} | {served_ms:.3f} |")


if __name__ == "__main__":
    main()
