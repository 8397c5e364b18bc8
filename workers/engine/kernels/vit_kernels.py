"""The ViT's two elementwise passes as hand-written Triton kernels, the CUDA path of ``fused.vit_rope`` (every Qwen
tower's rotary on q and k) and of Qwen3-VL's bilinear position embedding (``fused.qwen3_vit_pos_embed``).

Both were torch.compile'd sites, and for Qwen2.5-VL and Qwen3-VL (dense and MoE) the last ones: a model worker of
those families compiled nothing else, yet its first ViT call paid for importing Inductor, Dynamo's tracing and the
sites' cache loads or compiles (the 8B's warm start-up on an H200: 5-7 s before the ViT's first kernel;
docs/benchmarks.md "Start-up"). As Triton kernels they are compiled (or loaded from Triton's cache) by their start-up
probe, on the probe threads beside the others (runner/kernel_probes.py), and no torch.compile is left on those
families' start.

- Rotary: one program per patch reads its q and k rows ([H, D] each, strided inside the qkv projection's output),
  rotates both halves in float32 with the patch's cos and sin and rounds once, as the compiled ``fused.vit_rope``
  does, writing contiguous q and k. v stays where it is, except for an attention kernel that wants wider heads
  (``vit_rope_padded``: FA4 on Qwen3-VL's 72): then the same pass writes q, k and v zero-padded to its size, in place
  of three padding copies after it.
- Position embedding: one program per patch and column block gathers the 4 table rows of its bilinear taps, weighs
  them in float32 and sums them in tap order, as transformers' ``(embedding(taps) * weights).sum(1)`` does, without
  the [patches, 4, hidden] float32 intermediate.

The patch count is the grid and never an argument, so no image size compiles a new variant (the ViT's CUDA graphs
capture these kernels); head counts, head_dim and the hidden width are compile-time constants per model.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels.launch_helpers import pow2
from workers.engine.kernels.triton_switch import TritonSwitch

SWITCH = TritonSwitch("GLIMPSE_TRITON_VIT")
available = SWITCH.on  # the kernels run on CUDA tensors, or anywhere under TRITON_INTERPRET=1

POS_BLOCK = 512  # columns of the position table per program (Qwen3-VL's towers are 1,024-1,152 wide)


def wanted(x: Tensor) -> bool:
    """Whether a ViT call on ``x`` takes these kernels: on CUDA (the CPU keeps the eager math of the exactness tests)
    while the switch is on."""
    return x.is_cuda and available()


@functools.cache
def _rope_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def vit_rope_kernel(
        qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, row_stride, part_stride, cs_stride,
        H: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr, HALFP: tl.constexpr,
        WIDTH: tl.constexpr, PADP: tl.constexpr, PARTS: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HP)[:, None]
        cols = tl.arange(0, HALFP)[None, :]
        mask = (heads < H) & (cols < HALF)
        c = tl.load(cos_ptr + t * cs_stride + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * cs_stride + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        dtype = q_ptr.dtype.element_ty
        # [H, D] rows of q (part 0), k (1) and v (2) at qkv[t, part]; heads are D apart inside a part, WIDTH apart in
        # the outputs, whose columns past D are written as zeros
        for part in tl.static_range(PARTS):
            src = qkv_ptr + t * row_stride + part * part_stride + heads * (2 * HALF) + cols
            x1 = tl.load(src, mask=mask, other=0.0)
            x2 = tl.load(src + HALF, mask=mask, other=0.0)
            dst = (q_ptr if part == 0 else (k_ptr if part == 1 else v_ptr)) + t * (H * WIDTH) + heads * WIDTH
            if part < 2:
                x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
                tl.store(dst + cols, (x1 * c - x2 * s).to(dtype), mask=mask)
                tl.store(dst + cols + HALF, (x2 * c + x1 * s).to(dtype), mask=mask)
            else:  # v as it is
                tl.store(dst + cols, x1, mask=mask)
                tl.store(dst + cols + HALF, x2, mask=mask)
            if WIDTH > 2 * HALF:
                pad = tl.arange(0, PADP)[None, :]
                pad_mask = (heads < H) & (pad < WIDTH - 2 * HALF)
                tl.store(dst + 2 * HALF + pad, tl.zeros((HP, PADP), dtype=dtype), mask=pad_mask)

    return vit_rope_kernel


@functools.cache
def _pos_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def vit_pos_embed_kernel(table_ptr, taps_ptr, weights_ptr, out_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < WIDTH
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in tl.static_range(4):  # tap order, as the reference's sum over its 4 gathered rows
            row = tl.load(taps_ptr + t * 4 + i).to(tl.int64)
            w = tl.load(weights_ptr + t * 4 + i)
            acc += tl.load(table_ptr + row * WIDTH + cols, mask=mask, other=0.0).to(tl.float32) * w
        tl.store(out_ptr + t * WIDTH + cols, acc, mask=mask)

    return vit_pos_embed_kernel


def vit_rope(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``fused.vit_rope``: the ViT's [n, 3, H, D] q|k|v (each row's 3 x H x D values laid out in that order, rows at
    any stride) -> rotated q and k, each contiguous [n, H, D]; cos and sin float32 [n, D/2]."""
    q, k = _rope(qkv, cos, sin, qkv.shape[-1], with_v=False)
    return q, k


def vit_rope_padded(qkv: Tensor, cos: Tensor, sin: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """``vit_rope`` for an attention kernel that takes only some head sizes (FA4: multiples of 16; Qwen3-VL's towers
    have 72): rotated q and k and v as it is, each contiguous [n, H, width] with zeros past D, in the one pass that
    rotates q and k. Zero columns add nothing to q.k, and v's give zero output columns, which the projection after
    the attention reads against zero weights (VisionAttention)."""
    q, k, v = _rope(qkv, cos, sin, width, with_v=True)
    return q, k, v


def _rope(qkv: Tensor, cos: Tensor, sin: Tensor, width: int, with_v: bool) -> list[Tensor]:
    n, three, heads, d = qkv.shape
    if three != 3 or d % 2 or qkv.stride(3) != 1 or qkv.stride(2) != d or qkv.stride(1) != heads * d:
        raise ValueError(f"vit_rope wants [n, 3, H, D] rows of q|k|v, got {tuple(qkv.shape)} strides {qkv.stride()}")
    if width < d:
        raise ValueError(f"vit_rope: output heads of {width} columns cannot hold head_dim {d}")
    cos, sin = cos.contiguous(), sin.contiguous()
    outs = [torch.empty((n, heads, width), dtype=qkv.dtype, device=qkv.device) for _ in range(3 if with_v else 2)]
    if n:
        half = d // 2
        v_out = outs[2] if with_v else outs[0]  # without v the kernel never writes its third output
        _rope_kernel()[(n,)](
            qkv, cos, sin, outs[0], outs[1], v_out, qkv.stride(0), qkv.stride(1), cos.stride(0), H=heads,
            HALF=half, HP=pow2(heads), HALFP=pow2(half), WIDTH=width, PADP=pow2(max(width - d, 1)), PARTS=len(outs),
            num_warps=4 if heads * d > 1024 else 2,
        )  # fmt: skip
    return outs


def pos_embed(table: Tensor, taps: Tensor, weights: Tensor) -> Tensor:
    """Qwen3-VL's bilinear position embedding: float32 [D, hidden] = sum over the 4 taps of table[taps] * weights;
    table [positions, hidden] (the tower's dtype), taps int [D, 4], weights float32 [D, 4]."""
    rows, width = taps.shape[0], table.shape[1]
    table, taps, weights = table.contiguous(), taps.contiguous(), weights.contiguous()
    out = torch.empty((rows, width), dtype=torch.float32, device=table.device)
    if rows:
        _pos_kernel()[(rows, -(-width // POS_BLOCK))](table, taps, weights, out, WIDTH=width, BLOCK=POS_BLOCK,
                                                      num_warps=4)
    return out


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Both kernels once against the eager math (a Qwen3-VL-like head_dim of 72: halves off a power of two; the rotary
    also padded to 80, as FA4 takes it); a Triton that cannot compile here or a wrong answer turns them off for the
    process (the compiled versions and the padding copies serve)."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 3 * 3 * 72, generator=gen).to(device=device, dtype=dtype).view(5, 3, 3, 72)
    angles = (torch.rand(5, 36, generator=gen) * 10).to(device)
    table = torch.randn(9, 40, generator=gen).to(device=device, dtype=dtype)
    taps = torch.randint(0, 9, (6, 4), generator=gen).to(device)
    weights = torch.rand(6, 4, generator=gen).to(device)

    def check() -> bool:
        from workers.engine.kernels import fused

        want = fused.vit_rope(qkv, angles.cos(), angles.sin())
        pairs = [*zip(vit_rope(qkv, angles.cos(), angles.sin()), want),
                 (pos_embed(table, taps, weights), fused.qwen3_vit_pos_embed(table, taps, weights))]
        padded = vit_rope_padded(qkv, angles.cos(), angles.sin(), 80)  # FA4's heads for 72: the same, then zeros
        pairs += [(got[..., :72], ref) for got, ref in zip(padded, (*want, qkv[:, 2]), strict=True)]
        pads_zero = not any(bool(got[..., 72:].any()) for got in padded)
        return pads_zero and all(torch.allclose(g.float(), w.float(), rtol=2e-2, atol=2e-2) for g, w in pairs)

    return SWITCH.probe(check)
