"""glimpse's own Qwen2.5-VL vision tower (ViT + patch merger).

Numerically equal to transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` (same parameter names, so a
checkpoint loads by stripping ``model.visual.`` / ``visual.``), but built for serving:
- images of one call are packed into one sequence; attention is segmented by ``cu_seqlens`` (windows, or whole
  frames in the ``fullatt_block_indexes`` blocks), see vision_attention.py for the kernels;
- everything that depends only on an image's (t, h, w) grid is memoized per grid (see ``_GridPlan``);
- the per-batch index data goes to the device in one copy and no step reads a device value back to the host.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from itertools import accumulate
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.layers.linear import RMSNorm  # transformers' op order (fp32 normalize, cast, scale)
from workers.engine.layers.vision_attention import Segments, VisionAttention, varlen_available
from workers.engine.layers.vision_mlp import VisionMLP
from workers.engine.layers.vit_plans import CallPlans
from workers.engine.models.loader import iter_safetensors

logger = logging.getLogger(__name__)

AttnBackend = Literal["sdpa", "flash", "auto"]
Grid = tuple[int, int, int]

_ACTS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu, "gelu": F.gelu}  # Qwen2.5-VL vision uses silu


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
        v = cfg.get("vision_config", cfg)
        kw = {f.name: v[f.name] for f in fields(VisionSpec) if f.name in v}
        if "in_chans" in v:  # original Qwen checkpoints on the Hub spell it so
            kw.setdefault("in_channels", v["in_chans"])
        if "rope_theta" in (v.get("rope_parameters") or {}):  # transformers 5 nests it
            kw["rope_theta"] = v["rope_parameters"]["rope_theta"]
        if "fullatt_block_indexes" in kw:
            kw["fullatt_block_indexes"] = tuple(kw["fullatt_block_indexes"])
        return VisionSpec(**kw)

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


class _PatchEmbed(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        # The Conv3d only holds the checkpoint's weight (same name and shape). Its kernel equals its stride, so
        # it is a plain matmul over each flattened (C, T, P, P) patch: one GEMM instead of a cuDNN conv3d call.
        k = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.in_channels, spec.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, pixels: Tensor) -> Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1))


class _Block(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(spec.hidden_size, 1e-6), RMSNorm(spec.hidden_size, 1e-6)
        self.attn = VisionAttention(spec.hidden_size, spec.num_heads)
        self.mlp = VisionMLP(spec.hidden_size, spec.intermediate_size, _ACTS[spec.hidden_act])

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


class VisionTower(nn.Module):
    """Qwen2.5-VL vision encoder; encodes several images per call, packed into one sequence."""

    def __init__(self, spec: VisionSpec, attn_backend: AttnBackend = "auto", grid_cache: int = 128) -> None:
        super().__init__()
        if spec.window_size % (spec.spatial_merge_size * spec.patch_size):
            raise ValueError("window_size must be a multiple of spatial_merge_size * patch_size")
        self.spec, self.attn_backend, self.grid_cache_size = spec, attn_backend, grid_cache
        self.patch_embed = _PatchEmbed(spec)
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.depth))
        self.merger = _Merger(spec)
        self._full = frozenset(spec.fullatt_block_indexes)
        self._unit = spec.spatial_merge_size**2
        self._window_units = spec.window_size // spec.spatial_merge_size // spec.patch_size
        # Not a buffer, so .to(bfloat16) cannot round it (rotary angles are float32 math); explicitly on the CPU
        # because load_vision builds the module under a meta-device context.
        half = spec.head_dim // 2
        steps = torch.arange(0, half, 2, dtype=torch.float, device="cpu")
        self._inv_freq = 1.0 / (spec.rope_theta ** (steps / half))
        self._inv_freq_on: dict[torch.device, Tensor] = {}
        self._grids: OrderedDict[Grid, _GridPlan] = OrderedDict()
        self._warned_flash = False
        self._calls: CallPlans[_BatchPlan] = CallPlans()
        self.stats = {"calls": 0, "images": 0, "patches": 0, "grid_hits": 0, "grid_misses": 0, "plan_hits": 0}

    def tokens_per_image(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return t * h * w // self._unit

    def _grid_plan(self, grid: Grid) -> _GridPlan:
        plan = self._grids.pop(grid, None)  # re-inserted below as the most recently used
        self.stats["grid_misses" if plan is None else "grid_hits"] += 1
        if plan is None:
            plan = _plan_grid(grid, self.spec.spatial_merge_size, self._window_units)
        self._grids[grid] = plan
        if len(self._grids) > self.grid_cache_size:
            self._grids.popitem(last=False)
        return plan

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
        d_pos = d_pos.view(-1, 2).float()
        inv_freq = self._inv_freq_on.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[device] = self._inv_freq.to(device)
        angles = (d_pos[:, :, None] * inv_freq).flatten(1)  # [patches, head_dim // 2]: (row freqs, col freqs)
        windows = Segments(d_cu_win.int(), cu_win.tolist(), max(win_lens))
        frames = Segments(d_cu_frame.int(), cu_frame.tolist(), max(frame_lens), frames=True)
        return d_win, d_rev, angles.cos(), angles.sin(), windows, frames

    def _use_flash(self, x: Tensor) -> bool:
        if self.attn_backend == "sdpa":
            return False
        ok = varlen_available() and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
        if not ok and self.attn_backend == "flash" and not self._warned_flash:
            self._warned_flash = True
            logger.warning("vision attention: flash needs CUDA, fp16/bf16 and torch varlen_attn; using sdpa")
        return ok

    def forward(self, pixel_values: Tensor, grids: Sequence[Sequence[int]]) -> Tensor:
        """pixel_values [sum(t*h*w), in_channels*temporal_patch_size*patch_size**2]: several images' patches
        concatenated in order (as Qwen2VLImageProcessor emits them); grids: (t, h, w) in patches per image.
        Returns merged embeddings [sum(t*h*w // merge**2), out_hidden_size] in the same image order."""
        grid_keys = [(int(t), int(h), int(w)) for t, h, w in grids]
        n = sum(t * h * w for t, h, w in grid_keys)
        if pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grids say {n}")
        for key, count in (("calls", 1), ("images", len(grid_keys)), ("patches", n)):
            self.stats[key] += count
        weight = self.patch_embed.proj.weight
        if n == 0:
            return weight.new_empty(0, self.spec.out_hidden_size)
        plan, kept = self._calls.get((tuple(grid_keys), weight.device), lambda: self._batch_plan(grid_keys, weight.device))
        self.stats["plan_hits"] += kept
        window_index, reverse_index, cos, sin, windows, frames = plan
        # Reorder into window order once, before the patch embedding (it is per-row, so this commutes), so every
        # window and every frame is a contiguous segment for all blocks.
        pixels = pixel_values.to(weight.device, non_blocking=True).unflatten(0, (-1, self._unit))
        x = self.patch_embed(pixels[window_index].flatten(0, 1))
        flash = self._use_flash(x)
        delta: Tensor | None = None
        for i, block in enumerate(self.blocks):
            x, delta = block(x, delta, frames if i in self._full else windows, cos, sin, flash)
        return self.merger(x, delta)[reverse_index]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy tensors named relative to the tower (``blocks.0.attn.qkv.weight``) into its parameters; raises
        naming the tensors that fit no parameter and the parameters left without a tensor."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            param = params.get(name)
            if param is None or param.shape != tensor.shape:
                raise ValueError(f"vision weight {name} {tuple(tensor.shape)} fits no parameter")
            param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise KeyError(f"vision weights missing from the checkpoint: {missing[:8]}")
        return loaded

    def after_load(self) -> None:
        """GPU weight layout (see vision_mlp); the CPU keeps transformers' exact GEMMs."""
        if self.patch_embed.proj.weight.device.type == "cuda":
            for module in self.modules():
                if isinstance(module, VisionMLP):
                    module.pack()


def build_vision(
    spec: VisionSpec, *, dtype: torch.dtype, device: torch.device | str, attn_backend: AttnBackend = "auto"
) -> VisionTower:
    """The tower allocated on ``device`` in ``dtype``, weights not loaded (models.base.load_model fills it)."""
    device = torch.device(device)
    with torch.device("meta"):  # no throwaway host init: the real storage is allocated once, on the target
        tower = VisionTower(spec, attn_backend=attn_backend).to(dtype=dtype)
    tower.to_empty(device=device)
    return tower.eval()


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
    params = dict(tower.named_parameters())
    if load_format == "dummy":
        with torch.no_grad():
            gen = torch.Generator(device=tower.patch_embed.proj.weight.device).manual_seed(0)
            for name, p in params.items():
                if p.ndim > 1:
                    p.normal_(0.0, 0.02, generator=gen)
                else:  # biases 0, norm scales 1
                    p.fill_(0.0 if name.endswith("bias") else 1.0)
    else:
        prefixes = ("model.visual.", "visual.")
        weights = iter_safetensors(model_dir, name_filter=lambda n: n.startswith(prefixes))
        tower.load_weights((n.split("visual.", 1)[1], t) for n, t in weights)
    tower.after_load()
    return tower
