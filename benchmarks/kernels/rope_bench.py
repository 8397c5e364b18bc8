"""The LM's rotary on the fused qkv, per layer call: Inductor's kernels for ``fused.lm_rope`` against the Triton kernel
(workers/engine/kernels/rope_kernel.py), 7B shapes (28 query and 4 KV heads of 128), bf16, and the bandwidth each reaches
(qkv read once, q, k and v written once).

    python -m benchmarks.kernels.rope_bench --tokens 1,64,1024,4096,8192 [--decode-rows 1,4,16]

``--decode-rows``: the decode step's kernels on Qwen3-VL-8B's heads with the norms: the per-token and the per-head
kernel on a bf16 qkv, and a split-K qkv's 8 float32 partials summed by the sum pass then rotated, against the
per-head kernel summing them itself.

``--qwen3-5``: Qwen3.5-9B's gated attention around its attention call (16 query heads of 256 with their gates, 4 KV
heads, rotary on 64 dims of each head): the q/k norms, the partial rotary and the sigmoid output gate, eager against
compiled (qwen3_5/lm.py's ``qk_norm_partial_rope`` and ``gated_output``), graph-timed, at ``--tokens``.

    python -m benchmarks.kernels.rope_bench --qwen3-5 --tokens 1,64,2048,4096
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from benchmarks.args import parser
from benchmarks.checkpoints import QWEN3_5_9B_TEXT
from workers.engine.kernels import fused, rope_kernel
from workers.engine.kernels.skinny_gemm import Partials
from workers.engine.layers.linear import SINGLE_RANK
from workers.engine.models.qwen2_5_vl.lm import rope_tables
from workers.engine.models.qwen3_5.lm import GatedAttention, gated_output, qk_norm_partial_rope
from workers.engine.models.qwen3_5.spec import TextSpec
from workers.engine.models.qwen3_vl.lm import qwen3_qk_norm_rope


def graph_us(fn: Callable[[], object], reps: int = 20) -> float:
    """GPU time per call, from a CUDA graph of ``reps`` calls: a small kernel launched from Python would otherwise
    be timed at the host's launch rate (Triton's launcher costs more host time than a 15 us kernel)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokens", default="1,64,1024,4096,8192")
    ap.add_argument("--decode-rows", default="", help="comma-separated row counts of the decode kernels' table")
    ap.add_argument("--qwen3-5", action="store_true", help="only Qwen3.5-9B's gated attention, eager against compiled")
    args = ap.parse_args()
    if args.qwen3_5:
        qwen3_5_rows([int(v) for v in args.tokens.split(",")])
        return
    if args.decode_rows:
        decode_rows([int(v) for v in args.decode_rows.split(",")])
    hq, hkv, d = 28, 4, 128
    print(f"{torch.cuda.get_device_name()}, bf16, {hq}/{hkv} heads of {d}; us per call, GB/s")
    print(f"{'tokens':>7} {'compiled us':>12} {'GB/s':>7} {'Triton us':>10} {'GB/s':>7} {'speedup':>8}")
    for t in (int(v) for v in args.tokens.split(",")):
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
        angles = torch.rand(t, d, device="cuda") * 100
        cos, sin = rope_tables(angles.cos().bfloat16(), angles.sin().bfloat16())
        call = (qkv, cos, sin, hq * d, hkv * d, d)
        compiled = fused.compiled(fused.lm_rope)
        a = graph_us(lambda compiled=compiled, call=call: compiled(*call))  # type: ignore[misc]
        b = graph_us(lambda call=call: rope_kernel.lm_rope(*call))  # type: ignore[misc]
        gb = 2 * qkv.numel() * qkv.element_size() / 1e3  # bytes / us -> GB/s after the division below
        print(f"{t:>7} {a:>12.1f} {gb / a:>7.0f} {b:>10.1f} {gb / b:>7.0f} {a / b:>7.2f}x", flush=True)
    print("Qwen3 (per-head RMSNorm of q and k, then the rotary; 32/8 heads of 128 as in Qwen3-VL-8B):")
    hq, hkv = 32, 8
    w = torch.ones(d, device="cuda", dtype=torch.bfloat16)
    for t in (int(v) for v in args.tokens.split(",")):
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
        angles = torch.rand(t, d, device="cuda") * 100
        cos, sin = rope_tables(angles.cos().bfloat16(), angles.sin().bfloat16())
        norm_rope = fused.compiled(qwen3_qk_norm_rope)
        a = graph_us(lambda t_=(qkv, cos, sin), f=norm_rope: f(t_[0], w, w, 1e-6, t_[1], t_[2],  # type: ignore[misc]
                                                                 (hq * d, hkv * d, d)))
        b = graph_us(lambda t_=(qkv, cos, sin): rope_kernel.lm_rope(  # type: ignore[misc]
            t_[0], t_[1], t_[2], hq * d, hkv * d, d, (w, w, 1e-6)))
        gb = 2 * qkv.numel() * qkv.element_size() / 1e3
        print(f"{t:>7} {a:>12.1f} {gb / a:>7.0f} {b:>10.1f} {gb / b:>7.0f} {a / b:>7.2f}x", flush=True)


def decode_rows(rows: list[int]) -> None:
    print("decode rows, Qwen3-VL-8B heads (32/8 of 128) with the q/k norms; us per call")
    print("| rows | per token | per head | sum pass + per token | per head on the partials |")
    print("|---|---|---|---|---|")
    for t in rows:
        print(f"| {t} | " + " | ".join(f"{v:.2f}" for v in _decode_times(t)) + " |", flush=True)


def _decode_times(t: int, split: int = 8) -> list[float]:
    hq, hkv, d = 32, 8, 128
    w = torch.ones(d, device="cuda", dtype=torch.bfloat16)
    parts = torch.randn(split, t, (hq + 2 * hkv) * d, device="cuda")
    qkv = parts.sum(0).bfloat16()
    angles = torch.rand(t, d, device="cuda") * 100
    cos, sin = rope_tables(angles.cos().bfloat16(), angles.sin().bfloat16())
    sizes, norm = (hq * d, hkv * d, d), (w, w, 1e-6)
    product = Partials(parts, None, torch.bfloat16)
    return [
        graph_us(lambda: rope_kernel.lm_rope(qkv, cos, sin, *sizes, norm, by_head=False)),
        graph_us(lambda: rope_kernel.lm_rope(qkv, cos, sin, *sizes, norm, by_head=True)),
        graph_us(lambda: rope_kernel.lm_rope(product.settle(), cos, sin, *sizes, norm, by_head=False)),
        graph_us(lambda: rope_kernel.lm_rope(product, cos, sin, *sizes, norm)),
    ]

def qwen3_5_rows(tokens: list[int]) -> None:
    """Qwen3.5-9B's gated attention around the attention call, one layer: eager against compiled, us per call."""
    spec = TextSpec.from_hf_config({"text_config": QWEN3_5_9B_TEXT})
    layer = GatedAttention(spec, SINGLE_RANK).to("cuda", torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, bf16, Qwen3.5-9B gated attention: {spec.num_attention_heads}/"
          f"{spec.num_key_value_heads} heads of {spec.head_dim}, rotary on {spec.rotary_dim}; us per call (q/k prep "
          "+ output gate)")  # fmt: skip
    print("| tokens | eager | compiled | speed-up | max diff |\n|---|---|---|---|---|")
    for t in tokens:
        a, b, diff = _qwen3_5_times(layer, t)
        print(f"| {t} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {diff:.3g} |", flush=True)


def _qwen3_5_times(layer: GatedAttention, t: int) -> tuple[float, float, float]:
    d, r = layer.head_dim, layer.rotary_dim
    qkv = torch.randn(t, layer.q_gate_size + 2 * layer.kv_size, device="cuda", dtype=torch.bfloat16)
    q_gate, k, _ = qkv.split([layer.q_gate_size, layer.kv_size, layer.kv_size], dim=-1)
    q_gate = q_gate.view(t, -1, 2 * d)
    q, gate, k = q_gate[..., :d], q_gate[..., d:], k.view(t, -1, d)
    angles = torch.rand(t, r, device="cuda") * 100
    cos, sin = rope_tables(angles.cos().bfloat16(), angles.sin().bfloat16())
    out = torch.randn(t, q_gate.shape[1], d, device="cuda", dtype=torch.bfloat16)
    prep, gate_mul = fused.compiled(qk_norm_partial_rope), fused.compiled(gated_output)

    def eager() -> tuple[Tensor, Tensor, Tensor]:
        rotated = layer.rotate(layer.q_norm(q), cos, sin), layer.rotate(layer.k_norm(k), cos, sin)
        return *rotated, gated_output(out, gate)

    def compiled() -> tuple[Tensor, Tensor, Tensor]:
        rotated = prep(q, k, layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps, cos, sin, r)
        return *rotated, gate_mul(out, gate)

    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(eager(), compiled(), strict=True))
    return graph_us(eager), graph_us(compiled), diff


if __name__ == "__main__":
    main()
