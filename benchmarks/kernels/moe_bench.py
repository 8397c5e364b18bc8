"""A MoE layer's routed experts at decode row counts: the grouped GEMMs against the Triton kernels (moe_kernel.py,
and moe_batched.py's above moe_kernel.PAIR_MAX_ROWS rows).

    python -m benchmarks.kernels.moe_bench [--rows 1,2,4,8,16,32,64] [--shapes qwen3.5-35b-a3b,qwen3-30b-a3b,gemma4-26b-a4b]
    python -m benchmarks.kernels.moe_bench --sweep    # the kernels' tile sizes and warps, per shape and row count
    python -m benchmarks.kernels.moe_bench --batched-sweep --rows 32,64,128,256   # moe_batched.py's tiles

Per shape and row count: microseconds per layer of
* ``grouped``: the router's softmax / top-k / renormalisation in torch, then ``experts_grouped`` (sort, gather, two
  ``torch._grouped_mm``, SiLU*up, weight, scatter, sum): what a MoE layer ran before the kernels;
* ``kernels``: ``moe_kernel.route`` + ``moe_kernel.experts``, at every row count both ways: ``per pair``
  (moe_kernel.py's up and down kernels, a program per token-expert pair; what serves up to ``PAIR_MAX_ROWS``) and
  ``batched`` (moe_batched.py's, a program per expert and block of columns, each chosen expert read once; what serves
  above), with the kernels / grouped ratio of the one that serves;
* with ``--fp8``: ``kernels`` on FP8 stacks, one scale per row (a channel checkpoint's experts) and per 128 x 128
  tile (a block checkpoint's), per pair up to moe_kernel.MAX_ROWS rows and per expert above; and above, the block
  stacks through the grouped FP8 GEMMs they took before;
all after the router's projection (the same cuBLAS GEMV in each), replayed from a CUDA graph of 20 layers (each with
its own weights, so no layer finds the last one's in L2) as a decode step replays them; and the routed experts' weight
bytes the kernels stream over their time (each token-expert pair reads its expert's three matrices; the ceiling is
the card's bandwidth; above ``PAIR_MAX_ROWS`` rows, the distinct experts' bytes over the batched kernels' time). Also the
largest difference between the grouped and the served outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.args import parser
from workers.engine.kernels import moe_batched, moe_kernel
from workers.engine.kernels.fp8_quant import quantize_block, quantize_rows
from workers.engine.models.qwen3_vl.moe import experts_grouped

# (experts, top k, hidden, moe intermediate) of the published checkpoints.
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "qwen3.5-35b-a3b": (256, 8, 2048, 512),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "gemma4-26b-a4b": (128, 8, 2816, 704),
}
LAYERS = 20
# (up BLOCK_N, up BLOCK_K, down BLOCK_N, down BLOCK_K, warps) tried by --sweep.
TILES = ((16, 256, 16, 256, 8), (16, 256, 8, 256, 8), (16, 256, 32, 256, 8), (32, 256, 16, 256, 8),
         (8, 512, 16, 256, 8), (16, 256, 16, 128, 4), (8, 256, 8, 256, 4), (4, 512, 4, 512, 4))


def grouped(x: Tensor, router: Tensor, gate_up: Tensor, down: Tensor, k: int) -> Tensor:
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, k, dim=-1)
    weights = (top / top.sum(dim=-1, keepdim=True)).to(x.dtype)
    return experts_grouped(x, weights, ids, gate_up, down, fuse_act=True)


def kernels(x: Tensor, router: Tensor, gate_up: Tensor, down: Tensor, k: int) -> Tensor:
    weights, ids = moe_kernel.route(F.linear(x, router), k)
    return moe_kernel.experts(x, weights, ids, gate_up, down)


def kernels_fp8(x: Tensor, router: Tensor, gate_up: Tensor, down: Tensor, k: int, s_gu: Tensor, s_d: Tensor) -> Tensor:
    weights, ids = moe_kernel.route(F.linear(x, router), k)
    return moe_kernel.experts(x, weights, ids, gate_up, down, scales=(s_gu, s_d))


def grouped_fp8(x: Tensor, router: Tensor, gate_up: Tensor, down: Tensor, k: int, s_gu: Tensor, s_d: Tensor) -> Tensor:
    """What FP8 stacks ran above moe_kernel.MAX_ROWS rows before moe_batched.py took them: the grouped FP8 GEMMs."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, k, dim=-1)
    weights = (top / top.sum(dim=-1, keepdim=True)).to(x.dtype)
    return experts_grouped(x, weights, ids, gate_up, down, fuse_act=True, fp8_scales=(s_gu, s_d))


def fp8_layers(layers: Sequence[tuple[Tensor, ...]], quantize: object) -> list[tuple[Tensor, ...]]:
    """(router, FP8 gate_up, FP8 down, their scales) of each layer, quantized one expert at a time."""
    out: list[tuple[Tensor, ...]] = []
    for router, gate_up, down in layers:
        (q_gu, s_gu), (q_d, s_d) = ((torch.stack(t) for t in zip(*(quantize(w) for w in stack)))  # type: ignore[operator]
                                    for stack in (gate_up, down))
        out.append((router, q_gu, q_d, s_gu, s_d))
    return out


def replay_us(fn: object, layers: Sequence[tuple[Tensor, ...]], x: Tensor, k: int) -> float:
    """Microseconds per layer of ``fn`` over ``layers`` (router, gate_up, down[, scales]), captured once in a CUDA
    graph and replayed."""
    def step() -> None:
        for router, gate_up, down, *scales in layers:
            fn(x, router, gate_up, down, k, *scales)  # type: ignore[operator]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm (compiles the kernels) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / len(layers)


def with_limit(limit: int) -> object:
    """``kernels`` with moe_kernel.PAIR_MAX_ROWS at ``limit`` for the call: 1 << 20 forces the per-pair kernels at any
    row count, 0 moe_batched.py's."""
    def run(x: Tensor, router: Tensor, gate_up: Tensor, down: Tensor, k: int) -> Tensor:
        served, moe_kernel.PAIR_MAX_ROWS = moe_kernel.PAIR_MAX_ROWS, limit
        try:
            return kernels(x, router, gate_up, down, k)
        finally:
            moe_kernel.PAIR_MAX_ROWS = served
    return run


per_pair, batched_kernels = with_limit(1 << 20), with_limit(0)


# (BLOCK_M, up BLOCK_N, up BLOCK_K, down BLOCK_N, down BLOCK_K, warps, stages) of moe_batched.py tried by
# --batched-sweep.
BATCHED_TILES = ((16, 64, 64, 64, 64, 4, 3), (16, 32, 128, 32, 128, 4, 3), (16, 64, 128, 64, 128, 4, 3),
                 (16, 128, 64, 128, 64, 4, 3), (16, 64, 64, 64, 64, 4, 4), (16, 32, 64, 32, 64, 4, 4),
                 (32, 64, 64, 64, 64, 4, 3), (16, 64, 128, 64, 128, 8, 3), (16, 128, 128, 128, 128, 8, 3))


def batched_sweep(name: str, layers: list[tuple[Tensor, Tensor, Tensor]], k: int, rows: tuple[int, ...]) -> None:
    hidden = layers[0][0].shape[1]
    for tiles in BATCHED_TILES:
        (moe_batched.BLOCK_M, moe_batched.UP_BLOCK_N, moe_batched.UP_BLOCK_K, moe_batched.DOWN_BLOCK_N,
         moe_batched.DOWN_BLOCK_K, moe_batched.NUM_WARPS, moe_batched.NUM_STAGES) = tiles
        times = [replay_us(batched_kernels, layers, torch.randn(r, hidden, device="cuda", dtype=torch.bfloat16), k)
                 for r in rows]
        print(f"| {name} | {tiles} | " + " | ".join(f"{r} rows {t:.1f} us" for r, t in zip(rows, times)) + " |",
              flush=True)


def sweep(name: str, layers: list[tuple[Tensor, Tensor, Tensor]], k: int, rows: tuple[int, ...]) -> None:
    hidden = layers[0][0].shape[1]
    for tiles in TILES:
        (moe_kernel.UP_BLOCK_N, moe_kernel.UP_BLOCK_K, moe_kernel.DOWN_BLOCK_N, moe_kernel.DOWN_BLOCK_K,
         moe_kernel.NUM_WARPS) = tiles
        times = [replay_us(kernels, layers, torch.randn(r, hidden, device="cuda", dtype=torch.bfloat16), k)
                 for r in rows]
        print(f"| {name} | {tiles} | " + " | ".join(f"{r} rows {t:.1f} us" for r, t in zip(rows, times)) + " |",
              flush=True)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="time the kernels' tile choices instead")
    ap.add_argument("--batched-sweep", action="store_true", help="time moe_batched.py's tile choices instead")
    ap.add_argument("--fp8", action="store_true", help="also the kernels on FP8 stacks (row and block scales)")
    args = ap.parse_args()
    if not moe_kernel.probe(torch.device("cuda"), torch.bfloat16):
        raise SystemExit(f"the MoE kernels cannot run here: {moe_kernel.SWITCH.why_off()}")
    if not moe_kernel.probe_batched(torch.device("cuda"), torch.bfloat16):
        raise SystemExit(f"the batched MoE kernels cannot run here: {moe_batched.SWITCH.why_off()}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {LAYERS} layers per graph")
    fp8_cols = (" fp8 rows us | fp8 blocks us | fp8 blocks / kernels | fp8 blocks, grouped FP8 GEMMs us |"
                if args.fp8 else "")
    print("| shape | rows | grouped us | per pair us | batched us | kernels / grouped | kernels GB/s | max abs diff |"
          + fp8_cols)
    print("|---" * (8 + 4 * args.fp8) + "|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes.split(","):
        e, k, hidden, inter = SHAPES[name]
        layers = [(torch.randn(e, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) / hidden**0.5,
                   torch.randn(e, 2 * inter, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) / hidden**0.5,
                   torch.randn(e, hidden, inter, device="cuda", generator=gen, dtype=torch.bfloat16) / inter**0.5)
                  for _ in range(LAYERS)]
        if args.sweep:
            sweep(name, layers, k, (1, 4, 16))
            continue
        if args.batched_sweep:
            batched_sweep(name, layers, k, tuple(int(r) for r in args.rows.split(",")))
            continue
        if args.fp8:
            if not (moe_kernel.probe_fp8(torch.device("cuda"), torch.bfloat16)
                    and moe_kernel.probe_batched_fp8(torch.device("cuda"), torch.bfloat16)):
                raise SystemExit(f"the MoE kernels cannot run FP8 stacks here: {moe_kernel.FP8_SWITCH.why_off()}")
            by_rows, by_blocks = fp8_layers(layers, quantize_rows), fp8_layers(layers, quantize_block)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
            g_us = replay_us(grouped, layers, x, k)
            batched = rows > moe_kernel.PAIR_MAX_ROWS
            p_us = replay_us(per_pair, layers, x, k) if rows <= 256 else float("nan")
            b_us = replay_us(batched_kernels, layers, x, k) if rows <= 4 * moe_batched.MAX_ROWS else float("nan")
            k_us = b_us if batched else p_us
            router, gate_up, down = layers[0]
            diff = (grouped(x, router, gate_up, down, k).float() - kernels(x, router, gate_up, down, k).float())
            # Per pair each token-expert pair streams its expert's three matrices; batched each chosen expert once.
            _, ids = moe_kernel.route(F.linear(x, router), k)
            read = (int(ids.unique().numel()) if batched else rows * k) * 3 * inter * hidden * 2
            fp8 = ""
            if args.fp8 and rows <= 2 * moe_batched.MAX_ROWS:
                r_us, b_us = (replay_us(kernels_fp8, stacks, x, k) for stacks in (by_rows, by_blocks))
                bg_us = replay_us(grouped_fp8, by_blocks, x, k) if rows > moe_kernel.MAX_ROWS else float("nan")
                fp8 = f" {r_us:.1f} | {b_us:.1f} | {b_us / k_us:.2f} | {bg_us:.1f} |"
            print(f"| {name} | {rows} | {g_us:.1f} | {p_us:.1f} | {b_us:.1f} | {k_us / g_us:.2f} | {read / (k_us * 1e3):.0f} "
                  f"| {diff.abs().max().item():.3g} |" + fp8, flush=True)


if __name__ == "__main__":
    main()
