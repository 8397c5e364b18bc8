"""glimpse's Gemma 4 vision tower: transformers' ``Gemma4VisionModel`` followed by ``Gemma4MultimodalEmbedder``
(``model.embed_vision``), so its rows are already in the language model's hidden size.

The images of one call are packed into one sequence of patch rows, without the padding rows transformers' image
processor adds (those are masked out of attention and pooling there, so dropping them changes nothing but work):
- patch embedding ``input_proj(2 * (x - 0.5))`` plus the learned 2-D position table's x row and y row;
- encoder layers with bidirectional attention within each image (varlen segments, never across images);
- the pooler: each k x k block of patches averaged (k = pooling_kernel_size) in float32, times sqrt(hidden);
- ``standardize`` (std_bias / std_scale), then the embedder's scale-less RMSNorm and its projection.
Output rows follow transformers' order: image after image, each image's pooled grid row-major.

Parameter and buffer names are the checkpoint's (``vision_tower.*``, ``embed_vision.*``), so weights load by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, NamedTuple, Self, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.kernels import fused
from workers.engine.layers.vision_attention import Segments
from workers.engine.layers.vit_graphs import ViTGraphs
from workers.engine.layers.vit_plans import CallPlans
from workers.engine.models.gemma4.vision_fused import fused_layer
from workers.engine.models.gemma4.vision_layers import (
    CLIP_DEFAULTS,
    ClippableLinear,
    EncoderLayer,
    use_flash,
    vit_rms_norm,
)
from workers.engine.models.qwen_vit import activation

AttnBackend = Literal["sdpa", "flash", "auto"]
DEFAULT_TEXT_HIDDEN = 2304  # Gemma4TextConfig's hidden_size, where config.json has no text_config
# With fused kernels on (CUDA): each encoder layer as two compiled pieces around attention (vision_fused.py); False
# keeps the layer's own forward, its elementwise runs compiled one by one (the benchmark's "fused ops" variant).
LAYER_PIECES = True


@dataclass(frozen=True)
class VisionSpec:
    """Shape of the vision tower and its embedder, from config.json's ``vision_config`` (defaults: transformers'
    Gemma4VisionConfig) and ``text_config.hidden_size`` (``out_hidden_size``, the embedder's output)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0  # axial 2-D rotary (transformers forces rope_type "axial" for the vision tower)
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    out_hidden_size: int = DEFAULT_TEXT_HIDDEN
    # What glimpse's Qwen-style plumbing reads: a patch row is 3 x patch x patch values, one frame per image.
    in_channels: int = 3
    temporal_patch_size: int = 1

    @property
    def spatial_merge_size(self) -> int:
        """Patches per LM token along each side: the pooling kernel."""
        return self.pooling_kernel_size

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch_size**2

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> VisionSpec:
        """The whole config.json, or a bare ``vision_config`` (then ``out_hidden_size`` is transformers' default text
        hidden size unless the dict itself carries ``out_hidden_size``)."""
        if "vision_config" in cfg:
            vision = cfg["vision_config"]
            if vision is None:
                raise ValueError(
                    "config.json's vision_config is null: this Gemma 4 checkpoint has no vision tower"
                )
            text = cfg.get("text_config") or {}
            out_hidden = text.get("hidden_size", DEFAULT_TEXT_HIDDEN)
        else:
            vision, out_hidden = cfg, cfg.get("out_hidden_size", DEFAULT_TEXT_HIDDEN)
        kw = {f.name: vision[f.name] for f in fields(VisionSpec) if f.name in vision}
        theta = (vision.get("rope_parameters") or {}).get("rope_theta", vision.get("rope_theta"))
        if theta is not None:
            kw["rope_theta"] = float(theta)
        kw["out_hidden_size"] = int(out_hidden)
        return VisionSpec(**kw)


class PatchEmbedder(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.input_proj = nn.Linear(spec.patch_dim, spec.hidden_size, bias=False)
        # [2, size, hidden]: row 0 indexed by a patch's column (x), row 1 by its row (y)
        self.position_embedding_table = nn.Parameter(
            torch.ones(2, spec.position_embedding_size, spec.hidden_size)
        )

    def forward(self, pixels: Tensor, xs: Tensor, ys: Tensor) -> Tensor:
        # No normalization in the image processor: the model maps [0, 1] to [-1, 1] itself, in the rows' dtype.
        pixels = 2 * (pixels - 0.5)
        weight = self.input_proj.weight
        table = self.position_embedding_table
        return self.input_proj(pixels.to(weight.dtype)) + (
            F.embedding(xs, table[0]) + F.embedding(ys, table[1])
        )


class Encoder(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            EncoderLayer(
                spec.hidden_size,
                spec.intermediate_size,
                spec.num_attention_heads,
                spec.num_key_value_heads,
                spec.head_dim,
                spec.hidden_activation,
                spec.rms_norm_eps,
                spec.use_clipped_linears,
            )
            for _ in range(spec.num_hidden_layers)
        )


class VisionModel(nn.Module):
    """The checkpoint's ``vision_tower``: parameters and buffers only; the tower runs them."""

    std_bias: Tensor
    std_scale: Tensor

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.patch_embedder = PatchEmbedder(spec)
        self.encoder = Encoder(spec)
        if spec.standardize:
            self.register_buffer("std_bias", torch.zeros(spec.hidden_size))
            self.register_buffer("std_scale", torch.ones(spec.hidden_size))


class MultimodalEmbedder(nn.Module):
    """The checkpoint's ``embed_vision``: scale-less RMSNorm, then a projection to the LM's hidden size."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.eps = spec.rms_norm_eps
        self.embedding_projection = nn.Linear(spec.hidden_size, spec.out_hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.embedding_projection(vit_rms_norm(x, None, self.eps))


class _Plan(NamedTuple):
    """A call's index data on the device; depends on its grids only (kept by CallPlans, which counts the bytes of
    its tensors: hence a tuple)."""

    xs: Tensor  # [N] int64 patch column, indexes the position table's x row
    ys: Tensor  # [N] int64 patch row
    pool_order: Tensor  # [N] int64: patches reordered so each output token's k*k patches are adjacent
    cos: Tensor  # [N, 1, head_dim] in the tower's dtype
    sin: Tensor
    seg: Segments  # one segment per image


def _pool_order(h: int, w: int, k: int) -> Tensor:
    """Patch indices (row-major within the image) of each k x k block, blocks row-major, patches within a block
    row-major: transformers' pooled order (``x // k + (w // k) * (y // k)``) with each block's patches in index order."""
    rows = torch.arange(h).view(h // k, k, 1, 1) * w
    cols = torch.arange(w).view(1, 1, w // k, k)
    return (rows + cols).permute(0, 2, 1, 3).flatten()


class Gemma4VisionTower(nn.Module):
    """Gemma 4's vision encoder and multimodal embedder: several images' patch rows in, LM-width embeddings out."""

    def __init__(self, spec: VisionSpec, attn_backend: AttnBackend = "auto") -> None:
        super().__init__()
        activation(spec.hidden_activation)  # raises for an unsupported one before anything is allocated
        if spec.head_dim % 4:
            raise ValueError(f"vision head_dim {spec.head_dim}: the axial rotary needs a multiple of 4")
        if spec.in_channels != 3 or spec.temporal_patch_size != 1:
            raise ValueError("Gemma 4's vision tower takes single-frame RGB patches")
        self.spec, self.attn_backend = spec, attn_backend
        self.vision_tower = VisionModel(spec)
        self.embed_vision = MultimodalEmbedder(spec)
        self.embed_width = spec.out_hidden_size
        self._unit = spec.pooling_kernel_size**2  # patches per LM token
        self._root_hidden = spec.hidden_size**0.5
        # Axial rotary frequencies: head_dim / 4 of them, shared by both axes. Host float32, not a buffer, so a
        # cast of the module cannot round them (towers are built under a meta-device context).
        spatial = spec.head_dim // 2
        steps = torch.arange(0, spatial, 2, dtype=torch.float, device="cpu")
        self._inv_freq = 1.0 / (spec.rope_theta ** (steps / spatial))
        self.call_plans: CallPlans[_Plan] = CallPlans()
        self.graphs = ViTGraphs()  # recurring small calls replayed from CUDA graphs (layers/vit_graphs.py)

    @classmethod
    def build(
        cls,
        spec: VisionSpec,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        attn_backend: AttnBackend = "auto",
    ) -> Self:
        """The tower on ``device`` in ``dtype``: parameters uninitialized (``load_weights`` or the loader's dummy fill
        sets them), the clip bounds and standardization buffers at transformers' initial values."""
        with torch.device("meta"):
            tower = cls(spec, attn_backend=attn_backend).to(dtype=dtype)
        tower = tower.to_empty(device=torch.device(device))
        tower.reset_buffers()
        return tower.eval()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Clip bounds to +-inf (no clipping), std_bias 0, std_scale 1: what transformers' init leaves."""
        for module in self.modules():
            if isinstance(module, ClippableLinear) and module.clipped:
                for name, value in CLIP_DEFAULTS.items():
                    getattr(module, name).fill_(value)
        if self.spec.standardize:
            self.vision_tower.std_bias.zero_()
            self.vision_tower.std_scale.fill_(1.0)

    def tokens_per_image(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return t * h * w // self._unit

    # ---- planning -----------------------------------------------------------------------------------------
    def _check_grid(self, grid: tuple[int, int, int]) -> None:
        t, h, w = grid
        k, size = self.spec.pooling_kernel_size, self.spec.position_embedding_size
        if t != 1 or h <= 0 or w <= 0 or h % k or w % k:
            raise ValueError(
                f"grid {grid}: need (1, h, w) with h and w positive multiples of pooling_kernel_size={k}"
            )
        if max(h, w) > size:
            raise ValueError(f"grid {grid}: a side past the position table's {size} entries")

    def _plan(self, grids: Sequence[tuple[int, int, int]], device: torch.device) -> _Plan:
        """Positions, pooling order and image bounds of a call, built on the host and copied in one transfer; the
        rotary tables are computed on the device from the positions."""
        k = self.spec.pooling_kernel_size
        xs, ys, orders, offset = [], [], [], 0
        for grid in grids:
            self._check_grid(grid)
            _, h, w = grid
            index = torch.arange(h * w)
            xs.append(index % w)
            ys.append(index // w)
            orders.append(_pool_order(h, w, k) + offset)
            offset += h * w
        lens = [h * w for _, h, w in grids]
        cu = torch.tensor([0, *lens]).cumsum(0)
        packed = torch.cat([*xs, *ys, *orders, cu])
        if device.type == "cuda":
            packed = packed.pin_memory()  # so non_blocking is truly asynchronous
        d_xs, d_ys, d_order, d_cu = packed.to(device, non_blocking=True).split(
            [offset, offset, offset, len(cu)]
        )
        # transformers' Gemma4VisionRotaryEmbedding: float32 angles per axis, laid out (x, x, y, y) over the head,
        # cast to the activations' dtype.
        positions = torch.stack((d_xs, d_ys), dim=-1)[:, :, None].float()
        angles = positions * self._inv_freq.to(device)  # [N, 2, head_dim / 4]
        dtype = self.embed_vision.embedding_projection.weight.dtype

        def layout(t: Tensor) -> Tensor:
            return torch.cat((t[:, 0], t[:, 0], t[:, 1], t[:, 1]), dim=-1).to(dtype)[:, None, :]

        seg = Segments(d_cu.int(), cu.tolist(), max(lens), frames=True)
        return _Plan(d_xs, d_ys, d_order, layout(angles.cos()), layout(angles.sin()), seg)

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(self, pixel_values: Tensor, grids: Sequence[Sequence[int]]) -> Tensor:
        """pixel_values [sum(h*w), 3*patch*patch]: several images' patch rows concatenated, image after image, each
        image's rows row-major over its patch grid, a row = (patch_y, patch_x, channel) flattened, values in [0, 1]
        (transformers' Gemma4ImageProcessor rows without its padding); grids: (1, h, w) in patches per image, h and
        w multiples of pooling_kernel_size. Returns [sum(h*w // k**2), out_hidden_size] in the same image order."""
        keys = [(int(t), int(h), int(w)) for t, h, w in grids]
        n = sum(t * h * w for t, h, w in keys)
        if pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grids say {n}")
        weight = self.embed_vision.embedding_projection.weight
        if n == 0:
            return weight.new_empty(0, self.embed_width)
        plan, _ = self.call_plans.get((tuple(keys), weight.device), lambda: self._plan(keys, weight.device))
        pixels = pixel_values.to(weight.device, non_blocking=True)
        return self.graphs.run((tuple(keys), pixels.dtype, weight.device), pixels, lambda p: self._encode(p, plan))

    def _encode(self, pixels: Tensor, plan: _Plan) -> Tensor:
        tower = self.vision_tower
        x = tower.patch_embedder(pixels, plan.xs, plan.ys)
        flash = use_flash(x, self.attn_backend)
        layers = tower.encoder.layers
        if LAYER_PIECES and len(layers) and layers[0].fused and fused.worth_it(x):
            act = self.spec.hidden_activation
            for layer in layers:
                x = fused_layer(cast(EncoderLayer, layer), x, plan.seg, plan.cos, plan.sin, flash, act)
        else:
            for layer in layers:
                x = layer(x, plan.seg, plan.cos, plan.sin, flash)
        # Pooler: the k*k patches of each token averaged in float32 (transformers' one-hot weights of 1/k^2), cast
        # back to the working dtype, then scaled by sqrt(hidden) in float32 (it can leave float16's range).
        blocks = x[plan.pool_order].view(-1, self._unit, x.shape[-1]).float()
        pooled = (blocks * (1.0 / self._unit)).sum(1).to(x.dtype).float() * self._root_hidden
        if self.spec.standardize:
            pooled = (pooled - tower.std_bias.float()) * tower.std_scale.float()
        out: Tensor = self.embed_vision(pooled.to(x.dtype))
        return out

    # ---- weights ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy (name, tensor) pairs, names as in the checkpoint without ``model.`` (``vision_tower.*``,
        ``embed_vision.*``), into the parameters and the persistent buffers (clip bounds, std_bias / std_scale),
        cast to their dtype and device. Every one must be given and every name must fit one; returns the names."""
        targets = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            target = targets.get(name)
            # a clip bound may be stored as a 0-d or a 1-element tensor
            scalar = target is not None and target.ndim == 0 and tensor.numel() == 1
            if target is None or (target.shape != tensor.shape and not scalar):
                unexpected.append(f"{name} {tuple(tensor.shape)}")
                continue
            target.copy_(tensor.reshape(target.shape))
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing or unexpected:
            raise ValueError(
                f"Gemma 4 vision weights do not fit the tower: missing {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''} ({len(missing)}), unexpected or misshapen {unexpected[:8]}"
                f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
            )
        return loaded


build_vision = Gemma4VisionTower.build
