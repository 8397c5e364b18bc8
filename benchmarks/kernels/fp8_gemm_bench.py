"""FP8 GEMMs (workers/engine/kernels/fp8_gemm.py) against bf16, at a model's LM projections, per row count.

    python -m benchmarks.kernels.fp8_gemm_bench [--size 8b] [--rows 1,2,4,8,16] [--chunks 512,2048,8192] [--moe]
    python -m benchmarks.kernels.fp8_gemm_bench --size 8b --sweep [--sweep-rows 1,4,16] [--proj qkv,o] [--sweep-modes dot,fma]

For each projection (qkv, o, gate_up, down) and each M (decode batches ``--rows``, prefill chunks ``--chunks``):
milliseconds per call of
* ``bf16``: F.linear on the bf16 weight (what an unquantized checkpoint runs);
* ``w8a16``: the weight-only Triton kernel (w8a16_gemm.py) on the 128x128 block-FP8 weight, activations in bf16
  (what ``GLIMPSE_FP8_GEMM=auto`` runs at decode rows);
* ``rowwise``: per-token activations x per-channel weights, ``torch._scaled_mm`` (compressed-tensors FP8_DYNAMIC);
* ``block``: per-1x128-group activations x 128x128 weight tiles, ``F.scaled_mm`` (Qwen's -FP8 repos);
* ``block-gemm`` and ``block-quant``: its two parts apart, the GEMM on activations quantized beforehand and the
  activations' quantization (fp8_act_quant.py's kernel on CUDA);
* ``row-block``: the same with one weight scale per row and 128 columns (fused layers not on 128-row boundaries);
* ``dequant``: the FP8 weight dequantized to bf16 each call, then F.linear (the fallback where no kernel runs);
each with the activation quantization included, and its error against the bf16 GEMM of the unquantized weight (relative
RMS). A kernel torch refuses for a shape prints ``refused``; ``-`` where it cannot run at all (its probe failed).
On CUDA each variant runs over a ring of distinct copies of the weight (at least RING_BYTES of bf16 weights, so the
50 MB L2 of an H200 does not hold them) captured in one CUDA graph and replayed, as the decode step runs: GPU time
only, no Python launch cost. ``--eager`` times one weight called from Python instead (how the numbers in
docs/benchmarks.md before w8a16 were taken). ``--moe``: the routed experts' grouped GEMMs at the 30B-A3B expert
shapes (``torch._grouped_mm`` bf16, ``torch._scaled_grouped_mm`` row-wise, fp8_grouped_block.py's block kernel).
``--sweep``: instead of the table, every tile of ``w8a16_gemm.candidates`` at each projection and ``--sweep-rows``
M (block scales) in each of ``--sweep-modes`` (w8a16_gemm.MODE_NAMES: dot, fp8-activations, fma; fma only up to
FMA_BLOCK_M rows), the best tile per (projection, M) against the default tile and bf16, then per projection the
tile with the least time summed over those M (serve it with ``GLIMPSE_W8A16_TILE=block_n,block_k,split_k,warps,
stages,mode``, or put it in w8a16_gemm.py's defaults).
On the CPU (``--device cpu``) only bf16, rowwise and dequant run: a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.args import parser
from benchmarks.engine.vit_bench import cuda_ms
from benchmarks.kernels.skinny_gemm_bench import graph_ms
from workers.engine.kernels import fp8_gemm, fp8_grouped_block, w8a16_gemm
from workers.engine.kernels.fp8_quant import BLOCK, quantize_block, quantize_rows

# (name, out features, in features) of one decoder layer's projections. 8b: Qwen3-VL-8B (hidden 4096, 32 q / 8 kv
# heads of 128, I 12288); 32b: Qwen3-VL-32B (5120, 64 / 8, 25600); 30b-a3b: the MoE's attention projections;
# tiny: a CPU smoke run.
SIZES: dict[str, tuple[tuple[str, int, int], ...]] = {
    "8b": (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)),
    "32b": (("qkv", 10240, 5120), ("o", 5120, 8192), ("gate_up", 51200, 5120), ("down", 5120, 25600)),
    "30b-a3b": (("qkv", 5120, 2048), ("o", 2048, 4096)),  # Qwen3-VL-30B-A3B's dense projections (32 / 4 heads)
    "tiny": (("qkv", 256, 256), ("down", 256, 512)),
}
# Qwen3-VL-30B-A3B's routed experts: 128 experts, top 8, hidden 2048, moe_intermediate 768.
MOE = (128, 8, 2048, 768)
VARIANTS = ("bf16", "w8a16", "rowwise", "block", "block-gemm", "block-quant", "row-block", "dequant")
RING_BYTES = 256 << 20


def timed_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        return float(cuda_ms(fn, reps))
    fn()
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - began) * 1e3 / reps


def ring_ms(fns: Sequence[Callable[[], object]], device: torch.device, reps: int, eager: bool) -> float:
    """ms per call over the ring of calls (each on its own weight copy): graph-replayed on CUDA unless ``eager``
    (then the first call alone, from Python)."""
    if eager or device.type != "cuda":
        return timed_ms(fns[0], device, reps)

    def run() -> None:
        for f in fns:
            f()

    return graph_ms(run, reps) / len(fns)


def ring(w: Tensor, eager: bool) -> list[Tensor]:
    """Distinct copies of ``w`` whose bytes together pass RING_BYTES (one when eager or on the CPU)."""
    copies = 1 if eager or not w.is_cuda else max(2, min(16, -(-RING_BYTES // (w.numel() * w.element_size()))))
    return [w] + [w.clone() for _ in range(copies - 1)]


def variant_fn(name: str, x: Tensor, w: Tensor) -> Callable[[], Tensor] | None:
    """The call for one variant at weight ``w`` (bf16 [N, K]), or None where it cannot run on this device."""
    if name == "bf16":
        return lambda: F.linear(x, w)
    recipe = {"block": "block", "block-gemm": "block", "block-quant": "block", "row-block": "row-block"}.get(name)
    if recipe is not None and not (x.is_cuda and fp8_gemm.probe(recipe, x.device)):
        return None  # no block recipe here, or its probe failed (fp8_gemm logs why)
    if name == "block-quant":
        return lambda: fp8_gemm.block_activations(x)[0]
    if name == "block-gemm":
        qb, sb = quantize_block(w)
        xq, sx = fp8_gemm.block_activations(F.pad(x, (0, 0, 0, -x.shape[0] % 4)))
        return lambda: fp8_gemm.block_mm(xq, sx, qb, sb, x.dtype)
    if name == "w8a16" and not (x.is_cuda and fp8_gemm.probe("w8a16", x.device)):
        return None  # Triton's kernel runs on CUDA only (its interpreter is the tests' business)
    if name == "rowwise":
        q, s = quantize_rows(w)
        return lambda: fp8_gemm.rowwise_linear(x, q, s)
    q, s = quantize_block(w)
    if name == "row-block":
        s = s.repeat_interleave(BLOCK, dim=0)[: w.shape[0]]
    if name == "dequant":
        return lambda: fp8_gemm.dequant_linear(x, q, s)
    if name == "w8a16":
        return lambda: w8a16_gemm.linear(x, q, s)
    return lambda: fp8_gemm.block_linear(x, q, s)


def rel_err(got: Tensor, ref: Tensor) -> float:
    return float((got.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt())


def dense_table(
    shapes: tuple[tuple[str, int, int], ...], ms: list[int], device: torch.device, reps: int, eager: bool
) -> None:
    print("| M | proj | N x K | " + " | ".join(f"{v} ms" for v in VARIANTS) + " | best FP8 / bf16 | errors (w8a16, rowwise, block) |")
    print("|---" * (len(VARIANTS) + 5) + "|")
    gen = torch.Generator(device=device).manual_seed(0)
    for proj, n, k in shapes:
        ws = ring(torch.randn(n, k, device=device, generator=gen).mul_(0.02).to(torch.bfloat16), eager)
        for m in ms:
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            cells, errors = [], []
            best = float("inf")
            for v in VARIANTS:
                fns = [variant_fn(v, x, w) for w in ws]
                if fns[0] is None:
                    cells.append("-")
                    continue
                calls = [f for f in fns if f is not None]
                try:
                    t = ring_ms(calls, device, reps, eager)
                except (RuntimeError, ValueError):
                    cells.append("refused")
                    continue
                cells.append(f"{t:.3f}")
                if v not in ("bf16", "dequant", "block-gemm", "block-quant"):  # the last two: parts of block
                    best = min(best, t)
                if v in ("w8a16", "rowwise", "block"):
                    errors.append(f"{rel_err(calls[0](), F.linear(x, ws[0])):.3f}")
            bf16 = float(cells[0])
            ratio = f"{best / bf16:.2f}" if best < float("inf") else "-"
            print(f"| {m} | {proj} | {n} x {k} | " + " | ".join(cells) + f" | {ratio} | {', '.join(errors)} |")


def sweep(
    shapes: tuple[tuple[str, int, int], ...], ms: list[int], device: torch.device, reps: int, modes: tuple[int, ...]
) -> None:
    """Every candidate tile of the w8a16 kernel in ``modes`` at each projection and M (block scales), graph-replayed."""
    names = {v: k for k, v in w8a16_gemm.MODE_NAMES.items()}
    print("| proj | N x K | M | bf16 ms | w8a16 default ms | default tile | best tile | best ms | best / bf16 | "
          + " | ".join(f"best {names[m]} ms" for m in modes) + " |")  # fmt: skip
    print("|---" * (9 + len(modes)) + "|")
    gen = torch.Generator(device=device).manual_seed(0)
    winners = []
    for proj, n, k in shapes:
        ws = ring(torch.randn(n, k, device=device, generator=gen).mul_(0.02).to(torch.bfloat16), False)
        qs = [quantize_block(w) for w in ws]
        default = w8a16_gemm.tile(n, k, torch.cuda.get_device_properties(device).multi_processor_count)
        totals: dict[w8a16_gemm.Tile, float] = {}
        runs: dict[w8a16_gemm.Tile, int] = {}
        for m in ms:
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            bf16 = ring_ms([functools.partial(F.linear, x, w) for w in ws], device, reps, False)
            times: dict[w8a16_gemm.Tile, float] = {}
            for t in dict.fromkeys([default, *w8a16_gemm.candidates(k, modes)]):
                if t.mode == w8a16_gemm.FMA and m > w8a16_gemm.FMA_BLOCK_M:
                    continue  # each further block of rows streams the weight again
                try:
                    times[t] = ring_ms([functools.partial(w8a16_gemm.linear, x, q, s, use=t) for q, s in qs], device, reps, False)
                except Exception:  # noqa: BLE001 - a tile Triton cannot build here (shared memory): skipped
                    continue
                totals[t] = totals.get(t, 0.0) + times[t]
                runs[t] = runs.get(t, 0) + 1
            top = min(times, key=times.__getitem__)
            tile_s = ",".join(map(str, top))
            per_mode = [min((v for t, v in times.items() if t.mode == mode), default=float("nan")) for mode in modes]
            print(f"| {proj} | {n} x {k} | {m} | {bf16:.4f} | {times.get(default, float('nan')):.4f} | "
                  f"{','.join(map(str, default))} | {tile_s} | {times[top]:.4f} | {times[top] / bf16:.2f} | "
                  + " | ".join(f"{v:.4f}" for v in per_mode) + " |")  # fmt: skip
        full = {t: v for t, v in totals.items() if runs[t] == len(ms)}  # tiles that ran at every M
        if full:
            top = min(full, key=full.__getitem__)
            winners.append(f"{proj} ({n} x {k}): {','.join(map(str, top))} ({full[top]:.4f} ms summed over M {ms})")
    print()
    print("Best tile per projection over all M (block_n,block_k,split_k,warps,stages,mode):")
    for line in winners:
        print("  " + line)


# (TILE_M, TILE_N, warps, stages) of fp8_grouped_block.py's kernel compared by --moe; the first is its default.
GROUPED_TILES = ((64, 128, 4, 3), (64, 128, 8, 4), (128, 128, 8, 4), (128, 256, 8, 3), (64, 256, 8, 3), (256, 128, 8, 3))


def moe_table(tokens: list[int], device: torch.device, reps: int) -> None:
    """Both expert projections of the 30B-A3B shape at each token count (randomly routed, top 8): bf16's
    ``torch._grouped_mm``, the row-wise ``torch._scaled_grouped_mm`` and the block kernel at each of GROUPED_TILES."""
    experts, top_k, hidden, inter = MOE
    gen = torch.Generator(device=device).manual_seed(1)
    names = ["x".join(map(str, t)) for t in GROUPED_TILES]
    print("| proj | tokens | rows | bf16 ms | rowwise ms | " + " | ".join(f"block {n} ms" for n in names)
          + " | best block / bf16 | errors (rowwise, block) |")  # fmt: skip
    print("|---" * (7 + len(names)) + "|")
    for proj, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        w = torch.randn(experts, n, k, device=device, generator=gen).mul_(0.02).to(torch.bfloat16)
        (q, s), (qb, sb) = quantize_rows(w), quantize_block(w)
        for t in tokens:
            rows = torch.randn(t * top_k, k, device=device, generator=gen).to(torch.bfloat16)
            ids = torch.randint(0, experts, (t * top_k,), device=device, generator=gen).sort().values
            offs = torch.searchsorted(ids, torch.arange(experts, device=device), right=True).to(torch.int32)
            ref = functools.partial(torch._grouped_mm, rows, w.transpose(1, 2), offs=offs)
            a = timed_ms(ref, device, reps)
            cells, errors, best = [], [], float("inf")
            calls = [functools.partial(fp8_gemm.grouped_mm, rows, q, s, offs)]
            calls += [functools.partial(fp8_grouped_block.grouped_mm, rows, qb, sb, offs, tiles) for tiles in GROUPED_TILES]
            for i, call in enumerate(calls):
                try:
                    ms = timed_ms(call, device, reps)
                except Exception:  # noqa: BLE001 - a kernel or tile this build refuses (shared memory, recipe)
                    cells.append("-")
                    continue
                cells.append(f"{ms:.3f}")
                best = min(best, ms) if i else best
                if i < 2:
                    errors.append(f"{rel_err(call(), ref()):.3f}")
            print(f"| {proj} | {t} | {t * top_k} | {a:.3f} | " + " | ".join(cells) + f" | {best / a:.2f} | {', '.join(errors)} |")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--size", default="8b", choices=sorted(SIZES))
    p.add_argument("--rows", default="1,2,4,8,16", help="decode batch sizes (M)")
    p.add_argument("--chunks", default="512,2048,8192", help="prefill chunk sizes (M)")
    p.add_argument("--moe", action="store_true", help="also the routed experts' grouped GEMM (CUDA)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--eager", action="store_true", help="time one weight from Python, not a graph-replayed ring")
    p.add_argument("--sweep", action="store_true", help="w8a16 tiles instead of the table (CUDA)")
    p.add_argument("--sweep-rows", default="1,4,16", help="M of the sweep")
    p.add_argument("--proj", default="", help="only these projections, e.g. qkv,o (default: all of --size)")
    p.add_argument("--sweep-modes", default="dot", help=f"w8a16 modes swept, of: {', '.join(w8a16_gemm.MODE_NAMES)}")
    args = p.parse_args()
    device = torch.device(args.device)
    shapes = tuple(s for s in SIZES[args.size] if not args.proj or s[0] in args.proj.split(","))
    ms = [int(v) for v in f"{args.rows},{args.chunks}".split(",") if v]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run: no FP8 tensor cores)"
    how = "eager, one weight" if args.eager or device.type != "cuda" else "graph-replayed weight ring"
    print(f"FP8 GEMMs at {args.size} projections on {where}, torch {torch.__version__}, {how}")
    if args.sweep:
        if device.type != "cuda":
            raise SystemExit("--sweep needs CUDA (the Triton kernel)")
        modes = tuple(w8a16_gemm.MODE_NAMES[v] for v in args.sweep_modes.split(","))
        sweep(shapes, [int(v) for v in args.sweep_rows.split(",")], device, args.reps, modes)
        return
    dense_table(shapes, ms, device, args.reps, args.eager)
    if args.moe and device.type == "cuda":
        print()
        moe_table([int(v) for v in args.rows.split(",")] + [int(v) for v in args.chunks.split(",")], device, args.reps)


if __name__ == "__main__":
    main()
