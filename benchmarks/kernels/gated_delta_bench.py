"""Gated DeltaNet's token mixing for one linear-attention layer (workers/engine/kernels/gated_delta.py: the causal
conv, then the gated delta rule): flash-linear-attention's kernels against the torch path, as prefill tokens per
second and decode step time; for decode also glimpse's in-place kernel (gated_delta_decode.py, the CUDA default), at
each ``--block-v`` and ``--warps`` it is given, with the rule's own time beside the layer's (conv and launches
included).

    python -m benchmarks.kernels.gated_delta_bench
    python -m benchmarks.kernels.gated_delta_bench --prefill "" --batch 1,16,64 --heads 16,48 --block-v 16,32,64
    python -m benchmarks.kernels.gated_delta_bench --prefill "" --batch 64,128 --heads 16,48 --block-v 8,16,32 --warps 1,2,4
    python -m benchmarks.kernels.gated_delta_bench --prefill 1024,8192 --batch 1,64,256
    python -m benchmarks.kernels.gated_delta_bench --device cpu --prefill 64 --batch 2 --heads 2,4 --dim 32
    python -m benchmarks.kernels.gated_delta_bench --decode-conv --batch 1,16,64 --heads 16,32  # the 9B's conv
    python -m benchmarks.kernels.gated_delta_bench --prefill-conv 8x256,2x2048,1x4096 --heads 16,32

``--decode-conv`` times an all-decode step's conv alone, from a CUDA graph as the decode step replays it: the
compiled path (fused.conv_decode and the windows' index_copy_, served where conv_decode.py's kernel is off) against
that Triton kernel, us per layer. ``--prefill-conv`` does the same for prefill steps' conv (the torch path against
causal_conv.py's kernel with its windows' write-back, as a Gated DeltaNet layer calls it).

Qwen3.5's shapes by default (16 key heads, 32 value heads, head dims 128, conv kernel 4), bf16 inputs and state
pools on the GPU (float32 on the CPU). Prefill: one prompt of N tokens from no state. Decode: B sequences of one
token each, every one from its slot's state. The fla rows (GPU with fla-core only) give their largest difference
from the torch path's output; "fla" and the in-place rows run the conv as served (on CUDA causal_conv.py's Triton
kernel for prefill, conv_decode.py's for decode), "fla, torch conv" and "torch" run it in torch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor

from benchmarks.args import parser
from benchmarks.kernels.rope_bench import graph_us
from workers.engine.kernels import causal_conv, conv_decode, fused, gated_delta, gated_delta_decode
from workers.engine.kernels.attention import AttentionMetadata, StateMetadata
from workers.engine.kernels.triton_switch import TritonSwitch

KERNEL = 4


def metadata(query_lens: list[int], device: torch.device) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    batch = len(query_lens)
    initial = [n == 1 for n in query_lens]  # decodes carry a state, a prompt starts from none
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        query_lens_cpu=query_lens, seq_lens_cpu=query_lens,
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        block_tables=torch.zeros(batch, 1, dtype=torch.int32, device=device),
        max_query_len=max(query_lens), max_seq_len=max(query_lens),
        state=StateMetadata(
            slots=torch.arange(batch, device=device), slots_cpu=list(range(batch)),
            has_initial=torch.tensor(initial, device=device), has_initial_cpu=initial,
        ),
    )


def layer_call(
    query_lens: list[int], heads: tuple[int, int], dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[Callable[[], Tensor], Callable[[], Tensor]]:
    """One layer's conv + rule over a step of these query lengths, on random inputs and pools; and the rule alone."""
    k_heads, v_heads = heads
    tokens, channels = sum(query_lens), (2 * k_heads + v_heads) * dim
    x = torch.randn(tokens, channels, device=device, dtype=dtype)
    weight = torch.randn(channels, KERNEL, device=device, dtype=dtype) * 0.5
    q, k = (torch.randn(tokens, k_heads, dim, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(tokens, v_heads, dim, device=device, dtype=dtype)
    g = -torch.rand(tokens, v_heads, device=device) * 0.2  # float32, as the model computes it
    beta = torch.rand(tokens, v_heads, device=device, dtype=dtype)
    conv = torch.randn(len(query_lens), channels, KERNEL - 1, device=device, dtype=dtype)
    ssm = torch.randn(len(query_lens), v_heads, dim, dim, device=device, dtype=dtype) * 0.1
    meta = metadata(query_lens, device)

    def call() -> Tensor:
        gated_delta.causal_conv1d(x, weight, None, conv, meta)
        return gated_delta.gated_delta_rule(q, k, v, g, beta, ssm, meta)

    def rule() -> Tensor:
        return gated_delta.gated_delta_rule(q, k, v, g, beta, ssm, meta)

    return call, rule


@contextmanager
def switched(switch: TritonSwitch, on: bool) -> Iterator[None]:
    """A Triton kernel's switch set for the block, as its environment variable sets it, then put back."""
    before = os.environ.get(switch.env)
    os.environ[switch.env] = "1" if on else "0"
    switch.reset()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(switch.env, None)
        else:
            os.environ[switch.env] = before
        switch.reset()


def decode_conv(batches: list[int], heads: tuple[int, int], dim: int) -> None:
    """An all-decode step's conv for one layer, graph-timed: the compiled path against conv_decode.py's kernel."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    channels = (2 * heads[0] + heads[1]) * dim
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {dtype}, {channels} conv channels")
    print("| sequences | compiled + index_copy_, us | Triton, us | speed-up | max diff |\n|---|---|---|---|---|")
    for batch in batches:
        wide = torch.randn(batch, channels + 64, device=device, dtype=dtype)
        x = wide[:, :channels]  # a strided view, as the in-projection's split gives it
        weight = torch.randn(channels, KERNEL, device=device, dtype=dtype) * 0.5
        meta = metadata([1] * batch, device)
        windows = torch.randn(batch, channels, KERNEL - 1, device=device, dtype=dtype)
        times, outs = [], []
        for on in (False, True):
            with switched(conv_decode.SWITCH, on), fused.forced():  # compiled at any batch, as in a graph's capture
                pool = windows.clone()
                outs.append(gated_delta.causal_conv1d(x, weight, None, windows.clone(), meta, fuse=True))
                times.append(graph_us(partial(gated_delta.causal_conv1d, x, weight, None, pool, meta, fuse=True)))
        diff = (outs[0].float() - outs[1].float()).abs().max().item()
        print(f"| {batch} | {times[0]:.1f} | {times[1]:.1f} | {times[0] / times[1]:.2f}x | {diff:.3g} |")


def prefill_conv(steps: list[tuple[int, int]], heads: tuple[int, int], dim: int) -> None:
    """A prefill step's conv for one layer as Gated DeltaNet calls it (q, k, v sections), graph-timed: the torch path
    against causal_conv.py's kernel with its windows' write-back. ``steps``: (sequences, tokens each), from no state."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    sections = (heads[0] * dim, heads[0] * dim, heads[1] * dim)
    channels = sum(sections)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {dtype}, {channels} conv channels")
    print("| step | torch path, us | Triton + write-back, us | speed-up | Triton GB/s (x read, y written) | max diff |")
    print("|---|---|---|---|---|---|")
    for n, length in steps:
        tokens = n * length
        wide = torch.randn(tokens, channels + (1 + dim) * heads[1], device=device, dtype=dtype)
        x = wide[:, :channels]  # the in-projection's first sections: rows strided by its z, b and a columns
        weight = torch.randn(channels, KERNEL, device=device, dtype=dtype) * 0.5
        meta = metadata([length] * n, device)
        windows = torch.randn(n, channels, KERNEL - 1, device=device, dtype=dtype)
        times, outs = [], []
        for on in (False, True):
            with switched(causal_conv.SWITCH, on):
                call = partial(gated_delta.causal_conv1d_sections, x, weight, None, windows.clone(), meta, sections)
                outs.append(torch.cat(call(), dim=1))
                times.append(graph_us(call))
        diff = (outs[0].float() - outs[1].float()).abs().max().item()
        rate = 2 * tokens * channels * x.element_size() / (times[1] * 1e-6) / 1e9
        print(f"| {n} x {length} | {times[0]:.1f} | {times[1]:.1f} | {times[0] / times[1]:.2f}x | {rate:,.0f} | "
              f"{diff:.3g} |")


def ms_per_call(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()  # compile / warm up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prefill", default="1024,4096,16384", help="prompt lengths, comma-separated")
    ap.add_argument("--batch", default="1,16,64,256", help="decode batch sizes, comma-separated")
    ap.add_argument("--heads", default="16,32", help="key heads,value heads")
    ap.add_argument("--dim", type=int, default=128, help="key and value head dim")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--block-v", default=str(gated_delta_decode.BLOCK_V),
                    help="state columns a program of the in-place kernel owns, comma-separated")
    ap.add_argument("--warps", default=str(gated_delta_decode.NUM_WARPS),
                    help="warps per program of the in-place kernel, comma-separated")
    ap.add_argument("--decode-conv", action="store_true",
                    help="an all-decode step's conv alone, compiled against the Triton kernel (CUDA, --batch)")
    ap.add_argument("--prefill-conv", default="",
                    help="prefill steps' conv alone, torch against the Triton kernel (CUDA): sequences x tokens, "
                         "comma-separated, e.g. 8x256,2x2048")  # fmt: skip
    args = ap.parse_args()
    hk, hv = (int(h) for h in args.heads.split(","))
    if args.decode_conv:
        decode_conv([int(b) for b in args.batch.split(",") if b], (hk, hv), args.dim)
        return
    if args.prefill_conv:
        steps = [tuple(int(v) for v in step.split("x")) for step in args.prefill_conv.split(",")]
        prefill_conv([(n, length) for n, length in steps], (hk, hv), args.dim)
        return
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k_heads, v_heads = hk, hv
    paths = ["torch"] + (["fla, torch conv", "fla"] if gated_delta.fla_path(device) else [])
    in_place = [f"in place, BV {bv} warps {w}" for bv in args.block_v.split(",") for w in args.warps.split(",")]
    in_place = in_place if device.type == "cuda" else []
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {dtype}, heads {k_heads}/{v_heads} x {args.dim}, paths: {paths}")
    print("| case | tokens | path | ms per call | tokens/s | max diff vs torch | rule alone, graphed, ms |")
    print("|---|---|---|---|---|---|---|")
    cases = [("prefill", [int(n)]) for n in args.prefill.split(",") if n]
    cases += [(f"decode x{b}", [1] * int(b)) for b in args.batch.split(",") if b]
    envs = ("GLIMPSE_FLA", gated_delta_decode.SWITCH.env, causal_conv.SWITCH.env, conv_decode.SWITCH.env)
    before = [os.environ.get(env) for env in envs]
    block_v, warps = gated_delta_decode.BLOCK_V, gated_delta_decode.NUM_WARPS
    try:
        for case, lens in cases:
            baseline: Tensor | None = None
            decode = case.startswith("decode")
            for path in [p for p in paths if not (decode and p == "fla, torch conv")] + (in_place if decode else []):
                os.environ["GLIMPSE_FLA"] = "1" if path.startswith("fla") else "0"
                # the served conv (the Triton kernel on CUDA) except on the torch rows
                os.environ[causal_conv.SWITCH.env] = "0" if path in ("torch", "fla, torch conv") else "1"
                causal_conv.SWITCH.reset()
                os.environ[conv_decode.SWITCH.env] = "0" if path == "torch" else "1"
                conv_decode.SWITCH.reset()
                os.environ[gated_delta_decode.SWITCH.env] = "1" if path.startswith("in place") else "0"
                gated_delta_decode.SWITCH.reset()
                tiling = path.split()[3::2] if path.startswith("in place") else [block_v, warps]
                gated_delta_decode.BLOCK_V, gated_delta_decode.NUM_WARPS = (int(x) for x in tiling)
                torch.manual_seed(0)  # the same inputs for both paths
                call, rule = layer_call(lens, (k_heads, v_heads), args.dim, dtype, device)
                torch.manual_seed(0)
                out = layer_call(lens, (k_heads, v_heads), args.dim, dtype, device)[0]()  # fresh pools: comparable
                diff = "" if baseline is None else f"{(out.float() - baseline.float()).abs().max().item():.3g}"
                baseline = out if baseline is None else baseline
                ms = ms_per_call(call, device, args.reps)
                alone = f"{graph_us(rule, args.reps) / 1e3:.4f}" if path.startswith("in place") else ""
                print(f"| {case} | {sum(lens)} | {path} | {ms:.3f} | {sum(lens) / ms * 1e3:,.0f} | {diff} | {alone} |")
    finally:
        for env, value in zip(envs, before, strict=True):
            if value is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = value
        gated_delta_decode.SWITCH.reset()
        causal_conv.SWITCH.reset()
        conv_decode.SWITCH.reset()
        gated_delta_decode.BLOCK_V, gated_delta_decode.NUM_WARPS = block_v, warps


if __name__ == "__main__":
    main()
