"""Fused elementwise steps for the CUDA path: the work between the GEMMs, one kernel each.

Between its GEMMs a decoder layer or ViT block runs RMSNorms (seven PyTorch kernels each, with a float32
copy of the activations), rotary embeddings (four to six), SiLU*up and residual adds. For one 1080p image
the ViT spent 37 of its 67 ms in such kernels (H200 profile: GEMMs 19 ms, FlashAttention 11 ms), mostly
moving float32 intermediates through memory. Here each step is one function that torch.compile (Inductor)
turns into one or two Triton kernels that read the bf16 inputs once, do the math in float32 in registers
and write bf16 once.

Rules:
- The eager definitions are the reference; every module keeps its exact eager code for the CPU (float32
  tests compare tokens with transformers) and uses these only when ``fused`` is on and ``worth_it`` (CUDA,
  at least MIN_ROWS rows or a CUDA-graph capture). In bf16 the fused kernels round once where eager rounds after every op, so results differ at bf16
  precision (benchmarks/engine/precision_check.py measures it against a float32 engine).
- Shapes use torch.compile's automatic dynamic mode: the first call compiles for its exact shapes, the first
  call with another token count recompiles with only that dimension symbolic, and a count of 1 gets its own
  graph. Inner sizes (hidden 1280, heads x 80) stay static, which lets Inductor emit vectorised loads and
  one-pass reductions: with every dimension symbolic (``dynamic=True``) the same kernels ran 1.3-2.5x
  slower and the ViT took 42.2 instead of 37.1 ms per 1080p image (H200, measured). ``ModelRunner`` calls
  every site with three token counts at start-up, before any CUDA graph is captured (compiling or
  first-launching a kernel inside a capture is not allowed), so serving never compiles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.engine.kernels import silu_kernel
from workers.engine.kernels.skinny_gemm import Partials, settled

_compiled: dict[str, Callable[..., Any]] = {}

# Every row count takes the fused kernels now. Session 11 had measured the opposite below 256 rows (a compiled
# call's guards and dispatch, ~70 us, over the few eager kernels it replaced: eager batch-32 decode 14.1 -> 18.7 ms
# per step), but since the LM's rotary and SiLU*up have Triton kernels the eager side is the heavier one: a
# 180-token prefill step over a 22k-token context took 23-27 ms of host time fused against 26-32 eager, and eager
# decode steps without graphs (batch 32-200) were as fast or faster fused (H200, session 22). Small steps are
# host-bound, so this is their time to first token. (warm_fused compiles the one-row and symbolic graphs.)
MIN_ROWS = 1


_forced = False


def worth_it(x: Tensor | Partials) -> bool:
    """Whether a call site should take its fused kernel for input ``x`` (rows = tokens or patches; a split-K
    product's partials count their rows)."""
    if isinstance(x, Partials):
        x = x.parts[0]
    return x.is_cuda and (_forced or x.shape[0] >= MIN_ROWS or torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def forced() -> Iterator[None]:
    """Fused kernels at any row count: the start-up warm-up compiles the small-shape graphs that CUDA-graph
    captures will replay, since nothing may compile inside a capture."""
    global _forced
    _forced = True
    try:
        yield
    finally:
        _forced = False


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` through torch.compile, built on first use (importing dynamo costs ~1 s, which CPU runs skip)."""
    out = _compiled.get(fn.__qualname__)
    if out is None:
        # A site compiles once per dtype, inner size (LM and ViT hidden, head norms), one row or symbolic rows and
        # grad mode; a process serving one model stays under Dynamo's default of 8 graphs per function, but one
        # that runs several model shapes (the test suite) does not, and with fullgraph=True that is a hard error.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        out = _compiled[fn.__qualname__] = torch.compile(fn, dynamic=None, fullgraph=True)
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual add and the next norm in one pass: (x + delta, rms_norm(x + delta))."""
    s = x + delta
    return s, rms_norm(s, weight, eps)


def silu_mul(gate_up: Tensor) -> Tensor:
    """[T, 2I] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gated DeltaNet's output norm (transformers' ``Qwen3_5RMSNormGated``): RMSNorm over each value head, weight,
    times SiLU(gate), with the eager module's casts (qwen3_5/linear_attention.py ``GatedRMSNorm``)."""
    dtype = x.dtype
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (out * F.silu(gate.float())).to(dtype)


def delta_gates(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """Gated DeltaNet's per-head decay (log space, float32) and write strength: -exp(A_log) * softplus(a + dt_bias)
    and sigmoid(b), as the eager layer computes them."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def conv_decode(conv_state: Tensor, slots: Tensor, has_initial: Tensor, x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Gated DeltaNet's causal conv for one token per sequence, SiLU'd (gated_delta.causal_conv1d's all-decode branch):
    each row's window from its slot (zeros without initial state), the K taps' weighted sum, and the window after
    the token (in the pool's dtype, for the caller to write back). x [B, C], weight [C, K], conv_state [S, C, K-1]."""
    got = conv_state.index_select(0, slots).float()
    window = torch.where(has_initial.view(-1, 1, 1), got, torch.zeros((), dtype=got.dtype, device=got.device))
    taps = torch.cat([window.transpose(1, 2), x.float().unsqueeze(1)], dim=1)  # [B, K, C]
    y = F.silu((taps * weight.float().t()).sum(dim=1))
    return y.to(x.dtype), taps[:, 1:].transpose(1, 2).to(conv_state.dtype)


def qk_norm_partial_rope(
    q: Tensor, k: Tensor, q_w: Tensor, k_w: Tensor, eps: float, cos: Tensor, sin: Tensor, rotary_dim: int
) -> tuple[Tensor, Tensor]:
    """Qwen3.5's gated attention (qwen3_5/lm.py): the per-head q and k RMSNorms, then rotary on each head's first
    ``rotary_dim`` dims, in one pass per tensor, float32 in registers and rounded once; q [T, Hq, D] read in place from
    q_proj's [query | gate] rows, k [T, Hkv, D]. Eager takes ~7 kernels per tensor here (the norm, a flip, two
    multiplies, an add, a cat, and strided copies). Returns both contiguous. In float32 it is GatedAttention's eager
    math op for op. On CUDA: hybrid_kernels.py's kernel, or this compiled where that is off."""

    def norm_rotate(x: Tensor, weight: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        rot = xf[..., :rotary_dim]
        swapped = rot.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return torch.cat((rot * cos.float() + swapped * sin.float(), xf[..., rotary_dim:]), dim=-1).to(x.dtype)

    return norm_rotate(q, q_w), norm_rotate(k, k_w)


def gated_output(out: Tensor, gate: Tensor) -> Tensor:
    """Qwen3.5's gated attention: the attention output [T, H, D] times sigmoid of its gate (a strided [T, H, D] view
    of q_proj's rows) -> [T, H*D]; on CUDA one kernel (hybrid_kernels.py, or this compiled) where eager copies the
    gate, takes its sigmoid and multiplies."""
    t = out.shape[0]
    return out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))


def fast_silu_mul(gate_up: Tensor | Partials) -> Tensor:
    """The MLPs' fused SiLU*up: the hand-written Triton kernel (silu_kernel.py) where it runs, else the compiled
    ``silu_mul``. Both stream near bandwidth at the LM's width; at the ViT's (3,424) the compiled one reached only
    about half of it (H100: 0.142 vs 0.077 ms for one 1080p image's block, ``python -m benchmarks.kernels.silu_bench``).
    A split-K product's partials are summed inside the kernel, or by the sum pass before the compiled one."""
    if silu_kernel.available() and (gate_up.parts if isinstance(gate_up, Partials) else gate_up).is_cuda:
        return silu_kernel.silu_mul(gate_up)
    out: Tensor = compiled(silu_mul)(settled(gate_up))
    return out


def lm_rope(
    qkv: Tensor, cos: Tensor, sin_signed: Tensor, q_size: int, kv_size: int, head_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The LM's fused q|k|v projection output [T, q + 2kv] -> rotated q [T, Hq, D], rotated k and v
    [T, Hkv, D], all contiguous (what the KV write and FlashAttention read). cos/sin_signed [T, 1, D]
    as ``qwen2_5_vl.rope_tables`` makes them."""
    t = qkv.shape[0]
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)

    def rotate(x: Tensor) -> Tensor:
        x = x.view(t, -1, head_dim)
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return (x.float() * cos.float() + swapped.float() * sin_signed.float()).to(x.dtype)

    return rotate(q), rotate(k), v.reshape(t, -1, head_dim).contiguous()


def vit_rope(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The ViT's [n, 3, H, D] q|k|v -> rotated q and k, each contiguous [n, H, D]; cos, sin float32 [n, D/2] (the
    math vision._rope does, rounded once). v stays where it is (``qkv[:, 2]``): the attention kernels read rows at
    any stride, and its copy was 8.6 of the 842 ms an 8 x 1080p request spent on the GPU (H200)."""
    c, s = cos[:, None, :], sin[:, None, :]

    def rotate(x: Tensor) -> Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(qkv[:, 0]), rotate(qkv[:, 1])


def qwen3_vit_pos_embed(table: Tensor, taps: Tensor, weights: Tensor) -> Tensor:
    """Qwen3-VL's bilinear position embedding (qwen3_vl/vision.py), as transformers writes it: gather 4 rows, weight in
    float32, sum. On CUDA one kernel (vit_kernels.py, or this compiled), so the [patches, 4, hidden] float32
    intermediate is never written out."""
    return (F.embedding(taps, table) * weights[:, :, None]).sum(1)


def enable(module: torch.nn.Module, on: bool = True) -> int:
    """Switch every submodule that has a ``fused`` flag; returns how many were switched."""
    count = 0
    for m in module.modules():
        if isinstance(getattr(m, "fused", None), bool):
            setattr(m, "fused", on)  # noqa: B010 - nn.Module's __setattr__ typing rejects a plain bool
            count += 1
    return count
