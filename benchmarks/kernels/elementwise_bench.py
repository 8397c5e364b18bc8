"""The Triton kernels that replaced torch.compile'd sites, against those sites: the ViT's rotary and Qwen3-VL's
position embedding (vit_kernels.py), Qwen3.5's gated-attention and Gated DeltaNet passes (hybrid_kernels.py). With
``--passes vit-pad``, what a full block of a 72-wide tower does around FA4 (heads padded to 80) before and after the
padded rotary: the rotary then three padding copies against ``vit_rope_padded``, and the output's pad cut off by a
copy before the projection against the padded output into the projection re-laid with zero columns.

    python -m benchmarks.kernels.elementwise_bench [--passes vit,hybrid,vit-pad]

Shapes: ViT, one 1080p image (8,160 patches at 16 px, Qwen3-VL; 10,764 at 14 px, Qwen2.5-VL) and an 8 x 1080p
request; hybrid, the Qwen3.5-9B shape's layers (16 query and 4 KV heads of 256, rotary 64; 32 value heads of 128) at a
decode batch of 64 rows and a 4,096-token chunk. bf16 on the GPU. "first call" is the site's first use in this
process: for the compiled sites Dynamo's tracing and Inductor's compile or cache load (the first also imports
Inductor), for the kernels Triton's compile or cache load. Prints ms per call, the bandwidth over the bytes the pass
must move and the largest difference from the compiled site.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.args import parser
from benchmarks.engine.vit_bench import cuda_ms
from workers.engine.kernels import fused, hybrid_kernels, vit_kernels

# (shape, compiled call, kernel call, bytes the pass moves)
Case = tuple[str, Callable[[], object], Callable[[], object], int]
# (name, patches, heads, head_dim, hidden)
VIT_SHAPES = (("Qwen3-VL 1080p", 8160, 16, 72, 1152), ("Qwen2.5-VL 1080p", 10764, 16, 80, 1280),
              ("Qwen3-VL 8 x 1080p", 65280, 16, 72, 1152))
HYBRID_ROWS = (64, 4096)


def first_call_s(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def _rand(gen: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)


def vit_cases() -> Iterator[tuple[str, Case]]:
    rope, pos = fused.compiled(fused.vit_rope), fused.compiled(fused.qwen3_vit_pos_embed)
    for name, n, h, d, width in VIT_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        qkv = _rand(gen, n, 3 * h * d).view(n, 3, h, d)
        angles = torch.rand(n, d // 2, device="cuda", generator=gen) * 100
        cos, sin = angles.cos(), angles.sin()
        table = _rand(gen, 2304, width)
        taps = torch.randint(0, 2304, (n, 4), device="cuda", generator=gen)
        weights = torch.rand(n, 4, device="cuda", generator=gen)
        yield "ViT rotary", (name, partial(rope, qkv, cos, sin), partial(vit_kernels.vit_rope, qkv, cos, sin),
                             n * h * d * 2 * 2 * 2 + n * d * 4)  # read and write q and k, read cos and sin
        yield "ViT position embedding", (name, partial(pos, table, taps, weights),
                                         partial(vit_kernels.pos_embed, table, taps, weights),
                                         n * width * (4 * 2 + 4) + n * 4 * 12)  # 4 bf16 rows in, a float32 row out


def hybrid_cases() -> Iterator[tuple[str, Case]]:
    hq, hkv, d, r, hv, dv = 16, 4, 256, 64, 32, 128
    prep, gate_mul = fused.compiled(fused.qk_norm_partial_rope), fused.compiled(fused.gated_output)
    norm, gates = fused.compiled(fused.gated_rms_norm), fused.compiled(fused.delta_gates)
    for t in HYBRID_ROWS:
        gen = torch.Generator(device="cuda").manual_seed(0)
        name = f"Qwen3.5-9B, {t} rows"
        qkv = _rand(gen, t, (2 * hq + 2 * hkv) * d)
        q_gate = qkv[:, : 2 * hq * d].view(t, hq, 2 * d)
        q, gate, k = q_gate[..., :d], q_gate[..., d:], qkv[:, 2 * hq * d : (2 * hq + hkv) * d].view(t, hkv, d)
        w, cos, sin, attn = _rand(gen, d) * 0.1 + 1, _rand(gen, t, 1, r), _rand(gen, t, 1, r), _rand(gen, t, hq, d)
        args = (q, k, w, w, 1e-6, cos, sin, r)
        proj = _rand(gen, t, hv * dv + 2 * hv)
        x, z, nw = _rand(gen, t, hv, dv), proj[:, : hv * dv].view(t, hv, dv), _rand(gen, dv) * 0.1 + 1
        a, b = proj[:, hv * dv : hv * dv + hv], proj[:, hv * dv + hv :]
        a_log, dt_bias = torch.rand(hv, device="cuda", generator=gen), torch.randn(hv, device="cuda", generator=gen)
        yield "q/k norm + partial rotary", (name, partial(prep, *args), partial(hybrid_kernels.qk_norm_partial_rope,
                                                                             *args), t * (hq + hkv) * d * 2 * 2)
        yield "output gate", (name, partial(gate_mul, attn, gate), partial(hybrid_kernels.gated_output, attn, gate),
                              t * hq * d * 2 * 3)
        yield "gated norm", (name, partial(norm, x, z, nw, 1e-6), partial(hybrid_kernels.gated_rms_norm, x, z, nw, 1e-6),
                             t * hv * dv * 2 * 3)
        yield "delta gates", (name, partial(gates, a, b, a_log, dt_bias),
                              partial(hybrid_kernels.delta_gates, a, b, a_log, dt_bias), t * hv * (2 + 2 + 4 + 2))


Outputs = Tensor | Sequence[Tensor]


def pad_cases() -> Iterator[tuple[str, str, Callable[[], Outputs], Callable[[], Outputs]]]:
    """(what, shape, before, after) around a packed kernel that takes the 72-wide heads padded to 80."""
    for name, n, h, d, width in VIT_SHAPES:
        if d % 16 == 0:
            continue
        gen = torch.Generator(device="cuda").manual_seed(0)
        qkv = _rand(gen, n, 3 * h * d).view(n, 3, h, d)
        angles = torch.rand(n, d // 2, device="cuda", generator=gen) * 100
        cos, sin, pad = angles.cos(), angles.sin(), 16 - d % 16
        out = F.pad(_rand(gen, n, h, d), (0, pad))  # the packed call's output: v's zero columns
        weight, bias = _rand(gen, width, h * d), _rand(gen, width)
        padded = F.pad(weight.view(width, h, d), (0, pad)).reshape(width, -1)
        yield "q, k, v for the packed call", name, partial(_padding_copies, qkv, cos, sin, pad), partial(
            vit_kernels.vit_rope_padded, qkv, cos, sin, d + pad)
        yield "attention output -> proj", name, partial(_cut_then_project, out, d, weight, bias), partial(
            F.linear, out.reshape(n, -1), padded, bias)


def _padding_copies(qkv: Tensor, cos: Tensor, sin: Tensor, pad: int) -> list[Tensor]:
    """The path before vit_rope_padded: the rotary, then q, k and v each padded by a copy."""
    q, k = vit_kernels.vit_rope(qkv, cos, sin)
    return [F.pad(t, (0, pad)) for t in (q, k, qkv[:, 2])]


def _cut_then_project(out: Tensor, d: int, weight: Tensor, bias: Tensor) -> Tensor:
    """The path before the padded projection: the pad cut off by a copy, then the checkpoint's projection."""
    return F.linear(out[..., :d].reshape(out.shape[0], -1), weight, bias)


def _tensors(x: Outputs) -> list[Tensor]:
    return [x] if isinstance(x, Tensor) else list(x)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--passes", default="vit,hybrid", help="comma-separated, of: vit, hybrid, vit-pad")
    passes = ap.parse_args().passes.split(",")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if "vit-pad" in passes:
        print("| around FA4's padded heads | shape | before ms | after ms | after / before |\n|---|---|---|---|---|")
        for what, name, before, after in pad_cases():
            for g, w in zip(_tensors(after()), _tensors(before()), strict=True):
                torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
            ms = [cuda_ms(fn, 50) for fn in (before, after)]
            print(f"| {what} | {name} | {ms[0]:.4f} | {ms[1]:.4f} | {ms[1] / ms[0]:.3f} |")
        passes.remove("vit-pad")
    if not passes:
        return
    print("| pass | shape | compiled ms | Triton ms | Triton GB/s | compiled GB/s | first call compiled / Triton, s "
          "| max diff |")
    print("|---|---|---|---|---|---|---|---|")
    sources = {"vit": vit_cases, "hybrid": hybrid_cases}
    for what, (name, compiled, kernel, moved) in (case for p in passes for case in sources[p]()):
        firsts = (first_call_s(compiled), first_call_s(kernel))
        got, want = kernel(), compiled()
        pairs = zip(got, want) if isinstance(got, tuple) and isinstance(want, tuple) else [(got, want)]
        diff = max(float((g.float() - w.float()).abs().max()) for g, w in pairs
                   if isinstance(g, Tensor) and isinstance(w, Tensor))
        ms = [cuda_ms(fn, 50) for fn in (compiled, kernel)]
        print(f"| {what} | {name} | {ms[0]:.4f} | {ms[1]:.4f} | {moved / ms[1] / 1e6:.0f} | {moved / ms[0] / 1e6:.0f} "
              f"| {firsts[0]:.2f} / {firsts[1]:.2f} | {diff:.3g} |")


if __name__ == "__main__":
    main()
