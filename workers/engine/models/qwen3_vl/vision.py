"""glimpse's own Qwen3-VL vision tower (ViT, patch merger and DeepStack mergers).

Numerically equal to transformers' ``Qwen3VLVisionModel`` in float32 (same parameter names, so a checkpoint's
``model.visual.*`` / ``visual.*`` tensors load by name), built for serving on the Qwen-style tower of
models/qwen_vit.py, as the Qwen2.5-VL tower is, with the same attention (``VisionAttention``: grouped SDPA on the
CPU, FlashAttention varlen or cuDNN on CUDA):
- the images of one call are packed into one sequence; every block attends within whole frames (``cu_seqlens``
  per frame, no windows);
- everything that depends only on a frame's (h, w) is memoized (``_FramePlan``) and the per-call index data goes
  to the device in one copy;
- the output row of each image token holds the main merger's embedding followed by every DeepStack level's, so
  one embedding-cache entry per image carries all levels and any row slice of it stays self-contained.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.kernels import fused, vit_kernels
from workers.engine.layers.vision_attention import Segments, VisionAttention
from workers.engine.models.qwen_vit import AttnBackend, Grid, QwenVisionTower, activation, vision_fields

_EPS = 1e-6  # every LayerNorm of the tower

# On CUDA with the fused kernels on (fused.enable): the MLP's first projection and its tanh GELU as one cuBLASLt GEMM
# with the activation in its epilogue: the tower on 2 x 1080p 68.2 -> 64.8 ms with FA4's attention, 81.9 -> 80.4 with
# cuDNN's (H200, `python -m benchmarks.engine.qwen3_vit_bench`). A module switch so that the benchmark can time the two
# paths side by side.
GELU_EPILOGUE = True


@dataclass(frozen=True)
class VisionSpec:
    """Shape of the vision tower, from config.json's ``vision_config``."""

    # Defaults are transformers' Qwen3VLVisionConfig defaults, used where config.json omits a field.
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    out_hidden_size: int = 3584
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> VisionSpec:
        """Accepts the whole config.json dict or its ``vision_config``."""
        # transformers' attribute_map spellings, in case a config was written with them
        aliases = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}
        return VisionSpec(**vision_fields(cfg, VisionSpec, aliases))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class _FramePlan:
    """Everything about one (h, w) frame that does not depend on pixels, on the CPU, patches in merge-unit
    order (the order the image processor emits them). Depends on (h, w) only, so all frames of a video and
    every image of the same resized size share it; memoized because real traffic repeats a few sizes."""

    taps: Tensor  # [h*w, 4] rows of the learned position table each patch interpolates from
    weights: Tensor  # [h*w, 4] float32 bilinear weights of those rows
    positions: Tensor  # [h*w, 2] (row, col) rotary positions


def _axis_taps(index: Tensor, size: int, side: int) -> tuple[Tensor, Tensor]:
    """Bilinear (align_corners=True) taps and weights along one axis, in the exact op order and dtypes of
    transformers' ``get_vision_interpolation_indices_and_weights`` (its float32 rounding decides the weights)."""
    src = index.float() * (side - 1) / torch.full_like(index, size - 1).clamp(min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def _plan_frame(h: int, w: int, merge: int, side: int) -> _FramePlan:
    if h % merge or w % merge:
        raise ValueError(f"frame {h}x{w}: h and w must be multiples of spatial_merge_size={merge}")
    units_h, units_w = h // merge, w // merge
    # Patch order: merge units row-major, then the m x m patches of a unit row-major.
    unit_row = torch.arange(units_h).view(-1, 1, 1, 1)
    unit_col = torch.arange(units_w).view(1, -1, 1, 1)
    inner = torch.arange(merge)
    rows = (unit_row * merge + inner.view(1, 1, -1, 1)).expand(units_h, units_w, merge, merge).flatten()
    cols = (unit_col * merge + inner.view(1, 1, 1, -1)).expand(units_h, units_w, merge, merge).flatten()
    row_taps, row_weights = _axis_taps(rows, h, side)
    col_taps, col_weights = _axis_taps(cols, w, side)
    taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).flatten(1)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
    return _FramePlan(taps, weights, torch.stack((rows, cols), dim=-1))


class _MLP(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=True)
        self.act = activation(spec.hidden_act)
        self.gelu_tanh = spec.hidden_act == "gelu_pytorch_tanh"  # the GELU cuBLASLt's epilogue computes
        self.fused = False  # set by fused.enable

    def forward(self, x: Tensor) -> Tensor:
        if self.fused and self.gelu_tanh and GELU_EPILOGUE and fused.worth_it(x):
            # The [patches, intermediate] activation written once, by the GEMM, instead of written, read and written
            # again by a GELU kernel (torch falls back to GEMM then GELU where cuBLASLt cannot take the call).
            h = torch._addmm_activation(self.linear_fc1.bias, x, self.linear_fc1.weight.t(), use_gelu=True)
            return self.linear_fc2(h)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.hidden_size, eps=_EPS)
        self.norm2 = nn.LayerNorm(spec.hidden_size, eps=_EPS)
        self.attn = VisionAttention(spec.hidden_size, spec.num_heads)
        self.mlp = _MLP(spec)

    def forward(self, x: Tensor, seg: Segments, cos: Tensor, sin: Tensor, flash: bool) -> Tensor:
        # No fused add+LayerNorm here (unlike the Qwen2.5 tower's RMSNorm): torch's LayerNorm is already one kernel,
        # and each add compiled into the LayerNorm after it (the block's norm2, the next block's norm1) measured no
        # faster: 83.0 vs 82.8 ms for 2 x 1080p (H200; 48.4 vs 48.3 ms per image in an earlier tree).
        x = x + self.attn(self.norm1(x), seg, cos, sin, flash)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """2x2 patch merger. ``postshuffle`` (the DeepStack mergers) normalizes the concatenated 4 patches, the main
    merger each patch before concatenating."""

    def __init__(self, spec: VisionSpec, postshuffle: bool) -> None:
        super().__init__()
        self.hidden, self.merged = spec.hidden_size, spec.hidden_size * spec.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged if postshuffle else self.hidden, eps=_EPS)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, spec.out_hidden_size)

    def forward(self, x: Tensor, out: Tensor) -> None:
        """Merge ``x`` [patches, hidden] into ``out`` [units, out_hidden_size], a column slice of the tower's
        output, written in place (so the levels need no concatenation copy)."""
        h = self.norm(x.view(-1, self.merged)) if self.postshuffle else self.norm(x).view(-1, self.merged)
        h = F.gelu(self.linear_fc1(h))  # exact GELU here (nn.GELU in transformers), unlike the blocks' MLP
        torch.addmm(self.linear_fc2.bias, h, self.linear_fc2.weight.t(), out=out)


# (taps [D, 4], weights [D, 4] float32, positions [D, 2], rows [patches] or None, frames): D patches of the call's
# distinct frame shapes; ``rows`` maps every patch to its row in them (None when that is the identity).
_BatchPlan = tuple[Tensor, Tensor, Tensor, Tensor | None, Segments]


class VisionTower(QwenVisionTower[_BatchPlan]):
    """Qwen3-VL vision encoder: a learned position table, full-frame attention in every block, DeepStack mergers."""

    spec: VisionSpec
    patch_bias = True

    def __init__(self, spec: VisionSpec, attn_backend: AttnBackend = "auto", grid_cache: int = 128) -> None:
        activation(spec.hidden_act)  # raises for an unsupported one before anything is allocated
        levels = spec.deepstack_visual_indexes
        if len(set(levels)) != len(levels) or not all(0 <= i < spec.depth for i in levels):
            raise ValueError(f"deepstack_visual_indexes {levels}: need distinct blocks < depth {spec.depth}")
        super().__init__(spec, attn_backend, grid_cache)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.depth))
        self.merger = _Merger(spec, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(_Merger(spec, postshuffle=True) for _ in levels)
        self.deepstack_levels = len(levels)
        self.embed_width = spec.out_hidden_size * (1 + self.deepstack_levels)
        # block -> (merger, output column slot). transformers appends DeepStack features in block order and the
        # LM adds the k-th to its k-th layer, so the slots follow block order (= index order when sorted).
        self._deepstack = {b: (levels.index(b), 1 + slot) for slot, b in enumerate(sorted(levels))}
        self._side = int(spec.num_position_embeddings**0.5)
        self._frames: OrderedDict[tuple[int, int], _FramePlan] = OrderedDict()
        # CUDA: position-embedding interpolation in one kernel (vit_kernels.py; compiled where that is off).
        # fused.enable also switches the blocks' VisionAttention to its one-kernel rotary: both, compiled, took the
        # ViT from 48.2 to 42.0 ms per 1088x1920 image (H200, Qwen3-VL-8B shapes).
        self.fused = False

    def _frame_plan(self, hw: tuple[int, int]) -> _FramePlan:
        return self._memoized(self._frames, hw, lambda: _plan_frame(*hw, self.spec.spatial_merge_size, self._side))

    def _batch_plan(self, grids: Sequence[Grid], device: torch.device) -> _BatchPlan:
        """Plans of the call's distinct frame shapes, stitched on the host and shipped in one copy."""
        shapes = list(dict.fromkeys((h, w) for _, h, w in grids))
        plans = [self._frame_plan(s) for s in shapes]
        starts = dict(zip(shapes, accumulate((h * w for h, w in shapes), initial=0), strict=False))
        frame_lens = [h * w for t, h, w in grids for _ in range(t)]
        cu = torch.tensor([0, *frame_lens]).cumsum(0)
        # A frame's patches are its shape's rows; no map is needed when no shape repeats (the common case).
        identity = len(frame_lens) == len(shapes)
        rows: list[Tensor] = []
        if not identity:
            for t, h, w in grids:
                rows += [torch.arange(starts[(h, w)], starts[(h, w)] + h * w)] * t
        # the float32 weights ride in the int64 copy as their bit patterns
        weight_bits = [p.weights.view(torch.int32).long().flatten() for p in plans]
        taps = [p.taps.flatten() for p in plans]
        packed = torch.cat([*taps, *weight_bits, *(p.positions.flatten() for p in plans), cu, *rows])
        if device.type == "cuda":
            packed = packed.pin_memory()  # so non_blocking is truly asynchronous
        d, n = sum(h * w for h, w in shapes), sum(r.numel() for r in rows)
        sizes = [4 * d, 4 * d, 2 * d, len(cu), n]
        d_taps, bits, positions, d_cu, d_rows = packed.to(device, non_blocking=True).split(sizes)
        weights = bits.int().view(torch.float32).view(d, 4)
        frames = Segments(d_cu.int(), cu.tolist(), max(frame_lens), frames=True)
        return d_taps.view(d, 4), weights, positions.view(d, 2), None if identity else d_rows, frames

    def _encode(self, pixel_values: Tensor, plan: _BatchPlan) -> Tensor:
        """Each output row is the main merger's embedding, then each DeepStack level's (block order),
        out_hidden_size columns each."""
        taps, interp, positions, rows, frames = plan
        table = self.pos_embed.weight
        if self.fused and fused.worth_it(taps):
            if vit_kernels.wanted(taps):
                pos = vit_kernels.pos_embed(table, taps, interp)
            else:
                pos = fused.compiled(fused.qwen3_vit_pos_embed)(table, taps, interp)
        else:
            pos = fused.qwen3_vit_pos_embed(table, taps, interp)
        angles = self.rotary.angles(positions)  # [D, head_dim // 2]
        cos, sin = angles.cos(), angles.sin()
        if rows is not None:  # per distinct shape above; now per patch
            pos, cos, sin = pos[rows], cos[rows], sin[rows]
        weight = self.patch_embed.proj.weight
        x = self.patch_embed(pixel_values.to(weight.device, non_blocking=True)) + pos.to(weight.dtype)
        flash = self._use_flash(x)
        out = x.new_empty(pixel_values.shape[0] // self._unit, self.embed_width)
        width = self.spec.out_hidden_size
        for i, block in enumerate(self.blocks):
            x = block(x, frames, cos, sin, flash)
            level = self._deepstack.get(i)
            if level is not None:
                merger, slot = level
                self.deepstack_merger_list[merger](x, out[:, slot * width : (slot + 1) * width])
        self.merger(x, out[:, :width])
        return out


build_vision = VisionTower.build
