"""What the Qwen-style vision towers (Qwen2.5-VL's, Qwen3-VL's) share: the patch embedding, the 2-D rotary angles,
the activations, reading ``vision_config``, and a tower base that packs the images of one call into one sequence.

The base (``QwenVisionTower``) does everything around the blocks: the call's checks and counters, the per-grid plan
memo and the kept whole-call plans (``CallPlans``), the choice between the CUDA attention kernels and grouped SDPA,
loading weights by name, deterministic dummy weights, and allocation straight on the device. A family's tower
registers its blocks and mergers after ``super().__init__`` (so parameters keep the checkpoint's order) and
implements ``_batch_plan`` (a call's grids -> the index data its blocks need, on the device) and ``_encode``
(pixels + that plan -> the embedding rows).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import fields
from typing import Any, ClassVar, Generic, Literal, Protocol, Self, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.layers.vision_attention import varlen_available
from workers.engine.layers.vit_plans import CallPlans

logger = logging.getLogger(__name__)

AttnBackend = Literal["sdpa", "flash", "auto"]
Grid = tuple[int, int, int]
P = TypeVar("P", bound=tuple[object, ...])  # a family's whole-call plan
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


# Only activations whose transformers definition is exactly this torch op (ACT2FN["gelu_new"] is a Python formula
# that differs in the last bits, so it is not offered under the same name).
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu": F.gelu,
    "silu": F.silu,
}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"vision hidden_act {name!r} not supported (have {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def vision_fields(cfg: dict[str, Any], spec: type[Any], aliases: dict[str, str] | None = None) -> dict[str, Any]:
    """The fields of the dataclass ``spec`` found in config.json's ``vision_config`` (or in ``cfg`` itself, when it is
    one), list values as tuples; an alias (alias -> field) fills its field where the field's own name is absent, and
    ``rope_theta`` comes from ``rope_parameters`` where transformers 5 nests it."""
    v = cfg.get("vision_config", cfg)
    kw = {f.name: v[f.name] for f in fields(spec) if f.name in v}
    for alias, name in (aliases or {}).items():
        if alias in v:
            kw.setdefault(name, v[alias])
    if "rope_theta" in (v.get("rope_parameters") or {}):
        kw["rope_theta"] = v["rope_parameters"]["rope_theta"]
    return {name: tuple(value) if isinstance(value, list) else value for name, value in kw.items()}


class ViTSpec(Protocol):
    """What the shared pieces read of a family's VisionSpec."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def out_hidden_size(self) -> int: ...
    @property
    def in_channels(self) -> int: ...
    @property
    def patch_size(self) -> int: ...
    @property
    def temporal_patch_size(self) -> int: ...
    @property
    def spatial_merge_size(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def head_dim(self) -> int: ...


class VisionPatchEmbed(nn.Module):
    """Patch embedding. The Conv3d only holds the checkpoint's weight (and bias: Qwen3-VL's has one), same name and
    shape. Its kernel equals its stride, so it is a plain matmul over each flattened (C, T, P, P) patch: one GEMM
    instead of a cuDNN conv3d call."""

    def __init__(self, spec: ViTSpec, bias: bool) -> None:
        super().__init__()
        k = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.in_channels, spec.hidden_size, kernel_size=k, stride=k, bias=bias)

    def forward(self, pixels: Tensor) -> Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1), self.proj.bias)


class VisionRotaryEmbedding:
    """2-D rotary of the patches: head_dim / 4 frequencies for a patch's row, as many for its column.

    Not a module buffer, so ``.to(bfloat16)`` cannot round the frequencies (rotary angles are float32 math); built
    explicitly on the CPU, because towers are constructed under a meta-device context, and copied once per device."""

    def __init__(self, head_dim: int, theta: float) -> None:
        half = head_dim // 2
        steps = torch.arange(0, half, 2, dtype=torch.float, device="cpu")
        self.inv_freq = 1.0 / (theta ** (steps / half))
        self._on: dict[torch.device, Tensor] = {}

    def angles(self, positions: Tensor) -> Tensor:
        """(row, col) positions [P, 2] on the device -> float32 angles [P, head_dim // 2] (row freqs, col freqs)."""
        inv_freq = self._on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on[positions.device] = self.inv_freq.to(positions.device)
        return (positions[:, :, None].float() * inv_freq).flatten(1)


class QwenVisionTower(nn.Module, Generic[P]):
    """A Qwen-style vision encoder that encodes several images per call, packed into one sequence."""

    patch_bias: ClassVar[bool] = False  # whether the checkpoint's patch embedding has a bias

    def __init__(self, spec: ViTSpec, attn_backend: AttnBackend = "auto", grid_cache: int = 128) -> None:
        super().__init__()
        self.spec, self.attn_backend, self.grid_cache_size = spec, attn_backend, grid_cache
        self.patch_embed = VisionPatchEmbed(spec, bias=self.patch_bias)
        self.embed_width = spec.out_hidden_size  # columns of one output row (families with DeepStack widen it)
        self.rotary = VisionRotaryEmbedding(spec.head_dim, spec.rope_theta)
        self._unit = spec.spatial_merge_size**2  # patches per LM token
        self._warned_flash = False
        self.call_plans: CallPlans[P] = CallPlans()
        self.stats = {"calls": 0, "images": 0, "patches": 0, "grid_hits": 0, "grid_misses": 0, "plan_hits": 0}

    @classmethod
    def build(
        cls, spec: ViTSpec, *, dtype: torch.dtype, device: torch.device | str, attn_backend: AttnBackend = "auto"
    ) -> Self:
        """The tower on ``device`` in ``dtype``, weights uninitialized (``load_weights`` or ``init_dummy`` fills
        them): no throwaway host init, the real storage is allocated once, on the target."""
        with torch.device("meta"):
            tower = cls(spec, attn_backend=attn_backend).to(dtype=dtype)
        return tower.to_empty(device=torch.device(device)).eval()

    def tokens_per_image(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return t * h * w // self._unit

    def _batch_plan(self, grids: Sequence[Grid], device: torch.device) -> P:
        """A call's plan: index data of its grids, stitched on the host and shipped to ``device`` in one copy."""
        raise NotImplementedError

    def _encode(self, pixel_values: Tensor, plan: P) -> Tensor:
        """The call's pixels (as ``forward`` takes them, at least one patch) and its plan -> the output rows."""
        raise NotImplementedError

    def _memoized(self, memo: OrderedDict[K, V], key: K, build: Callable[[], V]) -> V:
        """``memo[key]``, built on a miss; the least recently used entry goes past ``grid_cache_size``. Recomputing a
        grid's plan per call (meshgrids, argsorts, host loops) is pure overhead, and real traffic repeats a handful
        of resized grids."""
        plan = memo.pop(key, None)  # re-inserted below as the most recently used
        self.stats["grid_misses" if plan is None else "grid_hits"] += 1
        if plan is None:
            plan = build()
        memo[key] = plan
        if len(memo) > self.grid_cache_size:
            memo.popitem(last=False)
        return plan

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
        concatenated in order (as the image processor emits them); grids: (t, h, w) in patches per image.
        Returns [sum(t*h*w // merge**2), embed_width] in the same image order."""
        grid_keys = [(int(t), int(h), int(w)) for t, h, w in grids]
        n = sum(t * h * w for t, h, w in grid_keys)
        if pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grids say {n}")
        for key, count in (("calls", 1), ("images", len(grid_keys)), ("patches", n)):
            self.stats[key] += count
        weight = self.patch_embed.proj.weight
        if n == 0:
            return weight.new_empty(0, self.embed_width)
        plan, kept = self.call_plans.get((tuple(grid_keys), weight.device), lambda: self._batch_plan(grid_keys, weight.device))
        self.stats["plan_hits"] += kept
        return self._encode(pixel_values, plan)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy (name relative to the tower, tensor) pairs into the parameters (cast to their dtype and device).
        Every parameter must be given and every name must fit one; returns the loaded names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            param = params.get(name)
            if param is None or param.shape != tensor.shape:
                unexpected.append(f"{name} {tuple(tensor.shape)}")
                continue
            param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing or unexpected:
            raise ValueError(
                f"vision weights do not fit the tower: missing {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''} ({len(missing)}), unexpected or misshapen {unexpected[:8]}"
                f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
            )
        return loaded

    @torch.no_grad()
    def init_dummy(self, seed: int = 0) -> None:
        """Deterministic random weights for runs without a checkpoint: matrices ~ N(0, 0.02), biases 0, norms 1."""
        gen = torch.Generator(device=self.patch_embed.proj.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
