"""Attention inside short packed segments (the ViT's windows), one Triton program per (segment, head).

Qwen2.5-VL's windowed blocks attend within 8 x 8-patch windows: a 1080p frame is 168 segments of at most 64 patches,
16 heads of 80. FlashAttention-2 varlen took 0.073 ms per block call for that frame (H200, `python -m
benchmarks.kernels.attn_bench --chunks "" --vit-fa3`), against a memory floor of ~2.3 us (q, k, v and out: 11 MB) and a few
us of tensor-core math: its 128-row tiles are half empty at 64 patches and head_dim 80 is padded to 96. Under the
64-concurrent load those calls were 0.19 s of a 7.7 s window (session 13's profile). FA3 was slower still
(0.127 ms): its tiles are made for long sequences.

Here a whole segment fits one tile, so there is no online softmax: each program loads its segment's q, k and v rows
for one head ([BLOCK_M, BLOCK_D], padded with zeros past the segment and past head_dim), takes S = q k^T on the
tensor cores in float32, a masked softmax in registers, and P v with P rounded to the input dtype as FlashAttention
does. Segments longer than MAX_LEN go to FlashAttention as before (``wanted``).

Only the CUDA path uses it; the CPU keeps grouped SDPA, which the exactness tests compare with transformers. The
segment count is the grid, not an argument Triton specialises on, so new images never compile a new variant.
"""

from __future__ import annotations

import functools
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels.triton_switch import TritonSwitch

MAX_LEN = 128  # longest segment one program holds ([128, 128] float32 scores: 64 KB of registers over 4 warps)

SWITCH = TritonSwitch("GLIMPSE_TRITON_WINDOWS")
available = SWITCH.on


def wanted(q: Tensor, max_len: int) -> bool:
    """Whether segments of at most ``max_len`` rows of ``q`` [n, H, D] should take this kernel."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and 0 < max_len <= MAX_LEN and available()


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def window_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, scale_log2,
        q_row, k_row, v_row, out_row,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        seg = tl.program_id(0)
        head = tl.program_id(1)
        start = tl.load(cu_ptr + seg)
        length = tl.load(cu_ptr + seg + 1) - start
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        rows = (start + offs_m).to(tl.int64)[:, None]
        cols = head * HEAD_DIM + offs_d[None, :]
        ok = (offs_m[:, None] < length) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(q_ptr + rows * q_row + cols, mask=ok, other=0.0)
        k = tl.load(k_ptr + rows * k_row + cols, mask=ok, other=0.0)
        v = tl.load(v_ptr + rows * v_row + cols, mask=ok, other=0.0)
        # scores in log2 units (scale * log2(e) folded in), so the softmax is one exp2 per element
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where((offs_m < length)[None, :], s, float("-inf"))  # keys past the segment
        p = tl.exp2(s - tl.max(s, axis=1)[:, None])
        total = tl.sum(p, axis=1)
        o = tl.dot(p.to(v.dtype), v) / total[:, None]
        tl.store(out_ptr + rows * out_row + cols, o.to(out_ptr.dtype.element_ty), mask=ok)

    return window_attention_kernel


def attend(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float, warps: int = 0) -> Tensor:
    """softmax(q k^T * scale) v within each segment ``cu[i]:cu[i+1]`` (int32, on q's device, every segment at most
    ``max_len`` <= MAX_LEN rows). q, k, v [n, H, D] may be strided views over tokens (v sliced from the fused qkv)
    as long as each row holds its heads back to back; returns a contiguous [n, H, D]. ``warps``: override the
    warps per program (benchmarks)."""
    n, heads, dim = q.shape
    if max_len > MAX_LEN:
        raise ValueError(f"segments of {max_len} rows exceed the kernel's {MAX_LEN}")
    q, k, v = (t if t.stride(2) == 1 and t.stride(1) == dim else t.contiguous() for t in (q, k, v))
    out = torch.empty((n, heads, dim), dtype=q.dtype, device=q.device)
    segments = cu.numel() - 1
    if n == 0 or segments == 0:
        return out
    block_m = max(16, 1 << (max_len - 1).bit_length())
    block_d = max(16, 1 << (dim - 1).bit_length())
    _kernel()[(segments, heads)](
        q, k, v, out, cu, scale * 1.4426950408889634,  # log2(e)
        q.stride(0), k.stride(0), v.stride(0), out.stride(0),
        HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps or (4 if block_m <= 64 else 8),
    )  # fmt: skip
    return out


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once (ragged segments, head_dim 80) against SDPA per segment; a Triton that cannot compile here
    or a wrong answer turns it off for the process (FlashAttention varlen serves instead)."""
    gen = torch.Generator().manual_seed(0)
    lengths = [64, 48, 5, 64]
    q, k, v = (torch.randn(sum(lengths), 2, 80, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    bounds = list(accumulate(lengths, initial=0))
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)

    def check() -> bool:
        got = attend(q, k, v, cu, max(lengths), 80**-0.5).float()
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            qs, ks, vs = (t[s:e].float().transpose(0, 1) for t in (q, k, v))
            want = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=80**-0.5).transpose(0, 1)
            if not torch.allclose(got[s:e], want, rtol=2e-2, atol=2e-2):
                return False
        return True

    return SWITCH.probe(check)
