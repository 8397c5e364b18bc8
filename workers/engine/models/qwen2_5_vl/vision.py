"""glimpse's own Qwen2.5-VL vision tower (ViT + patch merger).

Numerically equal to transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` (same parameter names, so a
checkpoint loads by stripping ``model.visual.`` / ``visual.``), but built for serving:
- images of one call are packed into one sequence; attention is segmented by ``cu_seqlens`` (windows, or whole
  frames in the ``fullatt_block_indexes`` blocks), see vision_attention.py for the kernels;
- everything that depends only on an image's (t, h, w) grid is memoized per grid (see ``_GridPlan``);
- the per-batch index data goes to the device in one copy and no step reads a device value back to the host.
What is not Qwen2.5-VL's own (patch embedding, rotary, the call's plumbing, weight loading) is in models/qwen_vit.py.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from workers.engine.layers.linear import RMSNorm  # transformers' op order (fp32 normalize, cast, scale)
from workers.engine.layers.vision_attention import Segments, VisionAttention
from workers.engine.layers.vision_mlp import VisionMLP
from workers.engine.models.loader import iter_safetensors
from workers.engine.models.qwen_vit import AttnBackend, Grid, QwenVisionTower, activation, vision_fields


@dataclass(frozen=True)
class VisionSpec:
    """Shape of the vision tower, from config.json's ``vision_config``."""

    # Defaults are transformers' Qwen2_5_VLVisionConfig defaults, used where config.json omits a field.
    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    out_hidden_size: int = 3584
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    tokens_per_second: float = 4  # video M-RoPE: temporal positions per second of video

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> VisionSpec:
        """Accepts the whole config.json dict or its ``vision_config``."""
        # original Qwen checkpoints on the Hub spell the input channels in_chans
        return VisionSpec(**vision_fields(cfg, VisionSpec, {"in_chans": "in_channels"}))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class _GridPlan:
    """Everything about one (t, h, w) grid that does not depend on pixels, on the CPU, in the image's own frame.

    Memoized because recomputing it per call (meshgrids, window padding, argsort, host loops) is pure overhead
    on the serving path: SGLang's seed PR #14292 measured ~7% end-to-end on single-image requests and ~2% TTFT
    under load from caching just the rotary position ids; real traffic repeats a handful of resized grids.
    """

    window_index: Tensor  # [units] merge-unit ids in window order (the permutation transformers applies)
    reverse_index: Tensor  # [units] its inverse, to put merged tokens back in raster order
    positions: Tensor  # [patches, 2] (row, col) rotary positions, already in window order
    window_lens: tuple[int, ...]  # patches per non-empty window, in window order
    frame_len: int  # h * w: full-attention blocks attend within one frame


def _plan_grid(grid: Grid, merge: int, window_units: int) -> _GridPlan:
    t, h, w = grid
    if h % merge or w % merge:
        raise ValueError(f"grid {grid}: h and w must be multiples of spatial_merge_size={merge}")
    lh, lw = h // merge, w // merge
    nwh, nww = -(-lh // window_units), -(-lw // window_units)
    frame = torch.arange(t).view(t, 1, 1)
    row, col = torch.arange(lh).view(1, lh, 1), torch.arange(lw).view(1, 1, lw)
    # Window id of each merge unit (frame-major, then window row, window col) and its slot inside the window;
    # sorting by (window, slot) gives the same order as transformers' pad-permute-filter construction.
    win = (frame * nwh + row // window_units) * nww + col // window_units
    slot = (row % window_units) * window_units + col % window_units
    window_index = torch.argsort((win * window_units**2 + slot).flatten())
    counts = torch.bincount(win.flatten(), minlength=t * nwh * nww)
    # Rotary (row, col) of every patch, in window order; a merge unit's patches are its m x m block, row-major.
    inner = torch.arange(merge * merge)
    rows = ((window_index % (lh * lw)) // lw)[:, None] * merge + inner // merge
    cols = (window_index % lw)[:, None] * merge + inner % merge
    positions = torch.stack((rows.flatten(), cols.flatten()), dim=-1)
    window_lens = tuple(int(c) * merge * merge for c in counts.tolist() if c)
    return _GridPlan(window_index, torch.argsort(window_index), positions, window_lens, frame_len=h * w)


# (window_index [units], reverse_index [units], cos and sin [patches, head_dim // 2] fp32, windows, frames)
_BatchPlan = tuple[Tensor, Tensor, Tensor, Tensor, Segments, Segments]


class _Block(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(spec.hidden_size, 1e-6), RMSNorm(spec.hidden_size, 1e-6)
        self.attn = VisionAttention(spec.hidden_size, spec.num_heads)
        self.mlp = VisionMLP(spec.hidden_size, spec.intermediate_size, activation(spec.hidden_act))

    def forward(
        self, x: Tensor, delta: Tensor | None, seg: Segments, cos: Tensor, sin: Tensor, flash: bool
    ) -> tuple[Tensor, Tensor]:
        """(residual stream, previous block's MLP output or None) -> the same pair after this block; the
        pending add happens inside the next norm (``RMSNorm.add``: one kernel on CUDA), same ops and order."""
        if delta is None:
            h = self.norm1(x)
        else:
            x, h = self.norm1.add(x, delta)
        x, h = self.norm2.add(x, self.attn(h, seg, cos, sin, flash))
        return x, self.mlp(h)


class _Merger(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.merged_dim = spec.hidden_size * spec.spatial_merge_size**2
        self.ln_q = RMSNorm(spec.hidden_size, 1e-6)
        dim = self.merged_dim
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, spec.out_hidden_size))

    def forward(self, x: Tensor, delta: Tensor | None = None) -> Tensor:
        normed = self.ln_q(x) if delta is None else self.ln_q.add(x, delta)[1]
        return self.mlp(normed.view(-1, self.merged_dim))


class VisionTower(QwenVisionTower[_BatchPlan]):
    """Qwen2.5-VL vision encoder: windowed blocks, full-attention ones at ``fullatt_block_indexes``."""

    spec: VisionSpec

    def __init__(self, spec: VisionSpec, attn_backend: AttnBackend = "auto", grid_cache: int = 128) -> None:
        if spec.window_size % (spec.spatial_merge_size * spec.patch_size):
            raise ValueError("window_size must be a multiple of spatial_merge_size * patch_size")
        super().__init__(spec, attn_backend, grid_cache)
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.depth))
        self.merger = _Merger(spec)
        self._full = frozenset(spec.fullatt_block_indexes)
        self._window_units = spec.window_size // spec.spatial_merge_size // spec.patch_size
        self._grids: OrderedDict[Grid, _GridPlan] = OrderedDict()

    def _grid_plan(self, grid: Grid) -> _GridPlan:
        return self._memoized(
            self._grids, grid, lambda: _plan_grid(grid, self.spec.spatial_merge_size, self._window_units)
        )

    def _batch_plan(self, grids: Sequence[Grid], device: torch.device) -> _BatchPlan:
        """Stitch the cached per-grid pieces with offsets on the host, then ship them in one copy."""
        plans = [self._grid_plan(g) for g in grids]
        offsets = [0, *accumulate(p.window_index.numel() for p in plans)]
        win_lens = [n for p in plans for n in p.window_lens]
        frame_lens = [p.frame_len for (t, _, _), p in zip(grids, plans, strict=True) for _ in range(t)]
        cu_win, cu_frame = torch.tensor([0, *win_lens]).cumsum(0), torch.tensor([0, *frame_lens]).cumsum(0)
        pieces = [p.window_index + o for p, o in zip(plans, offsets, strict=False)]
        pieces += [p.reverse_index + o for p, o in zip(plans, offsets, strict=False)]
        packed = torch.cat([*pieces, cu_win, cu_frame, *(p.positions.flatten() for p in plans)])
        if device.type == "cuda":
            packed = packed.pin_memory()  # so non_blocking is truly asynchronous
        units = offsets[-1]
        sizes = [units, units, len(cu_win), len(cu_frame), units * 2 * self._unit]
        d_win, d_rev, d_cu_win, d_cu_frame, d_pos = packed.to(device, non_blocking=True).split(sizes)
        angles = self.rotary.angles(d_pos.view(-1, 2))  # [patches, head_dim // 2]
        windows = Segments(d_cu_win.int(), cu_win.tolist(), max(win_lens))
        frames = Segments(d_cu_frame.int(), cu_frame.tolist(), max(frame_lens), frames=True)
        return d_win, d_rev, angles.cos(), angles.sin(), windows, frames

    def _encode(self, pixel_values: Tensor, plan: _BatchPlan) -> Tensor:
        """Merged embeddings [patches // merge**2, out_hidden_size], in raster order per image."""
        window_index, reverse_index, cos, sin, windows, frames = plan
        # Reorder into window order once, before the patch embedding (it is per-row, so this commutes), so every
        # window and every frame is a contiguous segment for all blocks.
        weight = self.patch_embed.proj.weight
        pixels = pixel_values.to(weight.device, non_blocking=True).unflatten(0, (-1, self._unit))
        x = self.patch_embed(pixels[window_index].flatten(0, 1))
        flash = self._use_flash(x)
        delta: Tensor | None = None
        for i, block in enumerate(self.blocks):
            x, delta = block(x, delta, frames if i in self._full else windows, cos, sin, flash)
        return self.merger(x, delta)[reverse_index]

    def after_load(self) -> None:
        """GPU weight layout (see vision_mlp); the CPU keeps transformers' exact GEMMs."""
        if self.patch_embed.proj.weight.device.type == "cuda":
            for module in self.modules():
                if isinstance(module, VisionMLP):
                    module.pack()


build_vision = VisionTower.build


def load_vision(
    model_dir: Path | str,
    spec: VisionSpec,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: Literal["auto", "dummy"] = "auto",
    attn_backend: AttnBackend = "auto",
) -> VisionTower:
    """The tower alone, with checkpoint weights (``auto``) or deterministic random ones (``dummy``: linear/conv
    weights ~ N(0, 0.02) from seed 0, biases 0, norms 1; config alone, no files). For tests and benchmarks of
    the tower by itself; serving goes through the family's ``build`` and ``load_model``."""
    tower = build_vision(spec, dtype=dtype, device=device, attn_backend=attn_backend)
    if load_format == "dummy":
        tower.init_dummy(seed=0)
    else:
        prefixes = ("model.visual.", "visual.")
        weights = iter_safetensors(model_dir, name_filter=lambda n: n.startswith(prefixes))
        tower.load_weights((n.split("visual.", 1)[1], t) for n, t in weights)
    tower.after_load()
    return tower
