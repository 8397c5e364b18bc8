"""The vision tower's attention: packed segments (windows or whole frames), rotary, and the kernels.

Every image of a ViT call is packed into one sequence; attention is segmented by ``cu_seqlens``. On CUDA the
windowed blocks run a Triton kernel made for short segments (window_attention.py; FlashAttention varlen where it
is off) and the full-attention blocks FA3 or cuDNN's fused SDPA, one call per frame; elsewhere grouped SDPA
(equal-length segments batched), which matches transformers in float32.

A packed kernel that takes only head sizes in multiples of 16 (FA4; Qwen3-VL's and Qwen3.5's towers have 72) gets the
heads zero-padded (80): once that is known the rotary's Triton pass writes q, k and v at that width, and the padded
output goes into ``proj`` as it comes, its weight re-laid once with zero input columns at the pad.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from workers.engine.kernels import fused, vit_kernels, window_attention
from workers.engine.kernels.paged_varlen import refusals

logger = logging.getLogger(__name__)

# Whether a layer whose packed kernel wants padded heads takes them from the rotary's pass (vit_rope_padded) rather
# than from padding copies after it; off only for benchmarks/engine/qwen3_vit_bench.py's comparison.
PADDED_ROTARY = True


@cache
def varlen_attn() -> Callable[..., Any] | None:
    """torch's public FlashAttention varlen (torch >= 2.10; the GPU box has 2.11; positional (q, k, v, cu_q, cu_k,
    max_q, max_k) is stable across them), or None. Looked up on first use, not at import: the module imports
    torch._dynamo, ~3 s of CPU that every process importing a model spec (launcher, scheduler, tokenizers) would
    otherwise pay at start-up, though only a CUDA model worker ever calls it."""
    try:
        from torch.nn.attention.varlen import varlen_attn as found
    except ImportError:  # pragma: no cover - older torch
        return None
    return found


def varlen_available() -> bool:
    return varlen_attn() is not None


@dataclass
class Segments:
    """Packed-attention segments: ``cu`` on device (int32, for varlen) plus host-side facts for SDPA grouping."""

    cu: Tensor
    cu_host: list[int]
    max_len: int
    frames: bool = False  # one segment per whole frame (the full-attention blocks)

    @cached_property
    def sdpa_groups(self) -> tuple[Tensor | None, Tensor | None, list[tuple[int, int, int]]]:
        """Reorder segments so equal-length ones are adjacent: one batched SDPA call per distinct length
        (a few per image) instead of one per window. Returns (perm, inverse perm, [(start, count, length)])."""
        bounds = list(zip(self.cu_host[:-1], self.cu_host[1:], strict=True))
        by_len: dict[int, list[tuple[int, int]]] = {}
        for s, e in bounds:
            by_len.setdefault(e - s, []).append((s, e))
        starts = accumulate((len(segs) * length for length, segs in by_len.items()), initial=0)
        groups = [(start, len(segs), length) for start, (length, segs) in zip(starts, by_len.items())]
        ordered = [b for segs in by_len.values() for b in segs]
        if ordered == bounds:  # e.g. full-attention blocks: one frame per segment, already in place
            return None, None, groups
        perm = torch.cat([torch.arange(s, e) for s, e in ordered])
        return perm.to(self.cu.device), torch.argsort(perm).to(self.cu.device), groups


class VisionAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=True)
        self.fused = False  # CUDA: rope of q and k in one kernel (vit_kernels.py; compiled where that is off)
        # The model on FA4 or FA3 (fa4_attention.py, fa3_attention.py): its packed call for whole frames on the CUDA
        # path (FA3: 1.5x cuDNN with no plan per frame length); windows keep their own kernel (FA3 is slower at 64
        # patches). None: cuDNN frames once hot, else FA2
        self.packed: Callable[..., Tensor] | None = None
        self.packed_pad = 0  # zero columns added to each head (set when the packed call refuses the head size as it is)
        self.proj_pad = 0  # zero input columns after each head in proj's weight (set by the first padded output)

    def forward(self, x: Tensor, seg: Segments, cos: Tensor, sin: Tensor, flash: bool) -> Tensor:
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)
        packed = flash and seg.frames and self.packed is not None
        if packed and self.packed_pad and self.fused and PADDED_ROTARY and vit_kernels.wanted(qkv):
            # the padded head size is known: the rotary's one pass writes q, k and v at it (no padding copies)
            q, k, v = vit_kernels.vit_rope_padded(qkv, cos, sin, self.head_dim + self.packed_pad)
        elif self.fused and fused.worth_it(qkv):
            q, k = vit_kernels.vit_rope(qkv, cos, sin) if vit_kernels.wanted(qkv) else fused.compiled(fused.vit_rope)(
                qkv, cos, sin)
            v = qkv[:, 2]  # a strided view: the CUDA kernels take row strides, and the CPU path copies where it must
        else:
            q, k = _rope(qkv[:, :2], cos[:, None, None], sin[:, None, None])
            v = qkv[:, 2]
        out = self._on_packed(q, k, v, seg) if packed else None
        if out is None:
            if q.shape[-1] != self.head_dim:  # padded for a packed call that then refused: the heads as they are
                q, k, v = (t[..., : self.head_dim].contiguous() for t in (q, k, v))
            if flash and seg.frames and _cudnn_frames.wants(seg):
                out = _cudnn_frames(q, k, v, seg)
            elif flash and window_attention.wanted(q, seg.max_len):
                out = window_attention.attend(q, k, v, seg.cu, seg.max_len, self.head_dim**-0.5)
            elif flash:
                out = _varlen(q, k, v, seg)
            else:
                out = _grouped_sdpa(q, k, v, seg)
        return self._project(out)

    def _project(self, out: Tensor) -> Tensor:
        """The output projection of [n, H, D] heads, or of the packed call's [n, H, D + pad] zero-padded ones: the
        first of those re-lays ``proj``'s weight with zero input columns at the pad (``proj_pad``), so it reads them
        as they come instead of after a copy that cuts the pad off (a 1080p image's block: 0.063 -> 0.037 ms with the
        GEMM, H100, docs/benchmarks.md); a default kernel's output is padded to match after."""
        n, width = out.shape[0], out.shape[-1]
        if width > self.head_dim and not self.proj_pad:
            self._pad_projection(width - self.head_dim)
        if self.proj_pad and width == self.head_dim:
            out = F.pad(out, (0, self.proj_pad))
        return self.proj(out.reshape(n, -1))

    @torch.no_grad()
    def _pad_projection(self, pad: int) -> None:
        weight = self.proj.weight  # [hidden, H x D]
        padded = F.pad(weight.view(weight.shape[0], self.num_heads, self.head_dim), (0, pad))
        self.proj.weight = nn.Parameter(padded.reshape(weight.shape[0], -1), requires_grad=False)
        self.proj.in_features = self.proj.weight.shape[1]
        self.proj_pad = pad

    def _on_packed(self, q: Tensor, k: Tensor, v: Tensor, seg: Segments) -> Tensor | None:
        """The packed FlashAttention call, or None once the kernel refuses one (its argument checks: a head size it
        lacks), after which this layer keeps its default kernels. A head size off a multiple of 16 (Qwen3-VL's 72) is
        first tried again zero-padded to one (80): zero columns add nothing to q.k, and v's give zero columns, which
        stay on the output (the projection reads them against zero weights)."""
        try:
            return self._packed_call(q, k, v, seg)
        except refusals() as exc:
            refused = str(exc).splitlines()[0][:200]
        if self.packed_pad == 0 and self.head_dim % 16:
            self.packed_pad = 16 - self.head_dim % 16
            try:
                out = self._packed_call(q, k, v, seg)
            except refusals():
                pass
            else:
                logger.info("vision attention: FlashAttention takes head size %d padded to %d",
                            self.head_dim, self.head_dim + self.packed_pad)
                return out
        logger.warning("vision attention: FlashAttention refused a call (%s); using the default kernels", refused)
        self.packed = None
        return None

    def _packed_call(self, q: Tensor, k: Tensor, v: Tensor, seg: Segments) -> Tensor:
        assert self.packed is not None
        width = self.head_dim + self.packed_pad  # q, k and v come at head_dim, or padded already by the rotary
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] != width else t for t in (q, k, v))
        return self.packed(q, k, v, seg.cu, seg.max_len, self.head_dim**-0.5)


def _varlen(q: Tensor, k: Tensor, v: Tensor, seg: Segments) -> Tensor:
    found = varlen_attn()
    assert found is not None
    out = found(q, k, v.contiguous(), seg.cu, seg.cu, seg.max_len, seg.max_len)
    assert isinstance(out, Tensor)
    return out


def _rope(qk: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary on q and k together ([n, 2, H, D]), in float32 like transformers: x*cat(c,c) + rotate_half(x)*cat(s,s),
    written on the halves. bf16 * fp32 widens exactly and each out= store rounds once, as the reference's final
    cast does, so no fp32 copy of q/k is made (half the bytes). Returns contiguous q and k."""
    x1, x2 = qk.chunk(2, dim=-1)
    out = qk.new_empty((2, qk.shape[0], *qk.shape[2:]))
    halves = out.transpose(0, 1).chunk(2, dim=-1)
    torch.sub(x1 * cos, x2 * sin, out=halves[0])
    torch.add(x2 * cos, x1 * sin, out=halves[1])
    return out[0], out[1]


class _CudnnFrames:
    """Whole-frame attention (the full-attention blocks) through cuDNN's fused SDPA, one call per frame.

    At 10,764 patches x 16 heads of 80 it takes 1.56 ms against 2.36 ms for FlashAttention-2 varlen (H200,
    measured): FA2 pads head_dim 80 to 96 and has no Hopper-specific path, cuDNN's kernel does. But cuDNN
    builds an execution plan for every new sequence length, ~37 ms each (same card), which one image of a new
    resolution would not earn back (4 blocks x 0.8 ms). So a frame length runs on FA2 varlen until it has
    been seen ``HOT_AFTER`` times (8 images' worth of full blocks): recurring resolutions (scans, screenshots,
    camera sizes) move to cuDNN, one-off sizes never pay for a plan. Windowed blocks never come here
    (windows of 64 patches: 0.09 ms on either). If cuDNN refuses a call, it is not tried again.
    """

    HOT_AFTER = 32  # full-block calls per frame length served by FA2 first (4 per image)
    MAX_TRACKED = 4096  # distinct lengths remembered; past that the counts restart

    def __init__(self) -> None:
        self.usable = True
        self._seen: dict[int, int] = {}

    def wants(self, seg: Segments) -> bool:
        """Count this call's frame lengths; True when cuDNN is usable and every one of them is hot."""
        if not self.usable:
            return False
        if len(self._seen) > self.MAX_TRACKED:
            self._seen.clear()
        hot = True
        for start, end in zip(seg.cu_host[:-1], seg.cu_host[1:], strict=True):
            count = self._seen[end - start] = self._seen.get(end - start, 0) + 1
            hot = hot and count > self.HOT_AFTER
        return hot

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, seg: Segments) -> Tensor:
        outs = []
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                for start, end in zip(seg.cu_host[:-1], seg.cu_host[1:], strict=True):
                    qf, kf, vf = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, L, D]
                    out = F.scaled_dot_product_attention(qf, kf, vf, scale=q.shape[-1] ** -0.5)
                    outs.append(out[0].transpose(0, 1))
        except RuntimeError as exc:
            self.usable = False
            logger.warning("vision attention: cuDNN SDPA unavailable (%s); using FlashAttention varlen", exc)
            return _varlen(q, k, v, seg)
        return torch.cat(outs) if len(outs) > 1 else outs[0]


_cudnn_frames = _CudnnFrames()

# Frame lengths the start-up warm-up runs through cuDNN: one a multiple of its tiles, one with a ragged tail.
WARM_LENGTHS = (1024, 8200)


def warm_cudnn_frames(attn: VisionAttention, device: torch.device, dtype: torch.dtype) -> None:
    """Pay cuDNN's first-use costs before serving: its engine libraries, and the runtime compilation of its
    generated attention kernels (a fresh machine has no CUDA JIT cache). Measured on an H200 on a fresh machine,
    the first hot frame length cost 1.0 s in one ViT call, stalling the first loaded steps; a later new length costs
    only its plan (35-60 ms). These calls do not count towards any length's `HOT_AFTER`."""
    # Only where the ViT's CUDA path runs: it (and cuDNN's own fallback) needs FlashAttention varlen.
    if not (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and varlen_available()):
        return
    if not _cudnn_frames.usable:
        return
    for length in WARM_LENGTHS:
        q = torch.zeros(length, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        bounds = [0, length]
        seg = Segments(torch.tensor(bounds, dtype=torch.int32, device=device), bounds, length, frames=True)
        _cudnn_frames(q, q, q, seg)


def _grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, seg: Segments) -> Tensor:
    perm, inv, groups = seg.sdpa_groups
    qkv = (q, k, v) if perm is None else (q[perm], k[perm], v[perm])
    outs = []
    for start, count, length in groups:
        # [count * length, H, D] -> [count, H, length, D]: each segment is one batch row, attending only to itself.
        q_g, k_g, v_g = (
            t[start : start + count * length].unflatten(0, (count, length)).transpose(1, 2) for t in qkv
        )
        # scale spelled as transformers does (head_dim**-0.5), which can differ from SDPA's default by an ulp
        out_g = F.scaled_dot_product_attention(q_g, k_g, v_g, scale=q.shape[-1] ** -0.5)
        outs.append(out_g.transpose(1, 2).flatten(0, 1))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out[inv] if inv is not None else out
