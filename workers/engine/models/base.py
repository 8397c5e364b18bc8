"""The model seam: what a family package provides and the one interface the runner, CUDA graphs, TP,
scheduler and caches see.

A family package (``workers/engine/models/<family>/``) exports ``FAMILY``, a ``ModelFamily``:
- ``parse(config_json, model_dir) -> ModelSpec`` (model_spec.py): every fact the other processes need, read once
  (in the launcher, or by the offline Engine) and shipped down frozen inside ``EngineConfig``;
- ``build(spec, tp, dtype, device, attn_backend, vision=True) -> VLModel``: the modules, allocated on the device in
  the dtype, weights not yet loaded (``load_model`` in load.py fills them: one safetensors walk for both towers);
  ``vision=False`` leaves the tower out (a model worker whose images encoder workers encode);
- ``positions`` / ``delta``: its M-RoPE variant (3 x T rows and the decode delta of a prompt with image
  spans; tokenizers need only the delta, model workers derive the rows themselves);
- ``write_demo(path)``: a tiny deterministic checkpoint of the family, for tests and ``glimpse serve``;
- ``video_layout`` (optional): how a video's frame groups sit in the prompt (the text replacing its
  placeholder, each group's temporal M-RoPE offset); each group is then a media item like an image.

The runner only calls ``VLModel``'s methods: ``embed``, ``encode``, ``forward``, ``compute_logits``,
``kv_cache_shape``; the per-image embedding width (``ModelSpec.embed_width``) sizes the embedding cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.kernels.backends import vision_kernel
from workers.engine.layers.deferred import deferred_weights
from workers.engine.layers.linear import TPGroup
from workers.engine.layers.vision_attention import VisionAttention
from workers.engine.models.model_spec import ModelSpec, VideoTiming

log = logging.getLogger("glimpse.model")

Grid = tuple[int, int, int]
# A video's frame group (one temporal patch of frames, encoded like one image): its index in the video and
# its temporal M-RoPE offset from the video's first group (0 for families that separate groups with text).
Frame = tuple[int, int]
# (offset, length, (t, h, w) in patches, frame: None for an image) of each span of a prompt, by offset.
Span = tuple[int, int, Grid, Frame | None]
PositionsFn = Callable[[int, Sequence[Span], int], tuple[list[list[int]], int]]
DeltaFn = Callable[[int, Sequence[Span], int], int]


class _SpanLike(Protocol):
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def grid(self) -> Grid: ...
    @property
    def frame(self) -> Frame | None: ...


def item_spans(items: Iterable[_SpanLike]) -> list[Span]:
    """The spans ``positions`` / ``delta`` take, from prompt spans or MMItems."""
    return [(it.offset, it.length, it.grid, it.frame) for it in items]


# (spec, timing, (video pad, vision start, vision end) token strings) -> (the text that replaces the video's
# placeholder token in the prompt, holding one video pad per frame group; each group's temporal offset).
VideoLayoutFn = Callable[[ModelSpec, VideoTiming, tuple[str, str, str]], tuple[str, list[int]]]


class LanguageModel(Protocol):
    """The decoder a family provides (an nn.Module)."""

    embed_tokens: nn.Module

    def __call__(
        self,
        inputs_embeds: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend | None = None,
        deepstack: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor: ...

    def compute_logits(self, hidden: Tensor) -> Tensor: ...

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]: ...

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]: ...


class VisionModel(Protocol):
    def __call__(self, pixel_values: Tensor, grids: Sequence[Sequence[int]]) -> Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]: ...


class NoVisionTower(RuntimeError):
    """A model built without its vision tower (``--encoder-workers``: encoder workers run it) was asked to encode."""


class VLModel(nn.Module):
    """A family's language model and vision tower behind the runner's interface. ``vision`` None: built without the
    tower (a split model worker's: encoder workers compute its image entries, which it imports)."""

    def __init__(self, spec: ModelSpec, lm: nn.Module, vision: nn.Module | None) -> None:
        super().__init__()
        self.spec = spec
        # Typed loosely: each family's modules follow LanguageModel / VisionModel above, structurally.
        self.lm: Any = lm
        self.vision: Any = vision

    @property
    def has_vision(self) -> bool:
        return self.vision is not None

    def embed(self, input_ids: Tensor) -> Tensor:
        out: Tensor = self.lm.embed_tokens(input_ids)
        return out

    def encode(self, pixel_values: Tensor, grids: Sequence[Grid]) -> Tensor:
        """Pixels of several images -> [tokens, embed_width]: each image token's main embedding, then its
        DeepStack levels (if the family has them), so one cache entry holds every level of an image."""
        if self.vision is None:
            raise NoVisionTower(
                f"this {self.spec.architecture} model was built without its vision tower (--encoder-workers: encoder "
                f"workers encode its images), but was asked to encode {len(grids)} image(s)"
            )
        out: Tensor = self.vision(pixel_values, grids)
        return out

    def forward(
        self,
        inputs_embeds: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend | None = None,
        mm_rows: Tensor | None = None,
        mm_embeds: Tensor | None = None,
    ) -> Tensor:
        """One LM forward over a flattened batch. ``mm_rows`` (int64 [N]) are the batch rows of image tokens
        and ``mm_embeds`` ([N, embed_width]) their cache rows: the main part replaces the token embeddings,
        the rest goes to the LM as DeepStack features."""
        deepstack = self.splice(inputs_embeds, mm_rows, mm_embeds)
        out: Tensor = self.lm(inputs_embeds, positions, kv_caches, meta, backend, deepstack)
        return out

    def splice(
        self, inputs_embeds: Tensor, mm_rows: Tensor | None, mm_embeds: Tensor | None
    ) -> tuple[Tensor, Tensor] | None:
        """Write the image tokens' main embeddings into ``inputs_embeds`` (in place); return their DeepStack
        features for the LM (rows, levels side by side), or None when the family has none or no row is an image."""
        if mm_rows is None or mm_embeds is None or not mm_rows.numel():
            return None
        hidden = self.spec.hidden_size
        # [:, :hidden]: an LM's token rows may be wider than hidden (Gemma 4's per-layer inputs ride beside them).
        inputs_embeds[mm_rows, :hidden] = mm_embeds[:, :hidden].to(inputs_embeds.dtype)
        if mm_embeds.shape[1] > hidden:
            return mm_rows, mm_embeds[:, hidden:].to(inputs_embeds.dtype)
        return None

    def compute_logits(self, hidden: Tensor) -> Tensor:
        out: Tensor = self.lm.compute_logits(hidden)
        return out

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        shape: tuple[int, ...] = self.lm.kv_cache_shape(num_blocks, block_size)
        return shape

    def after_load(self) -> None:
        """Let each part re-lay its weights for the device once they are in (e.g. packed GPU layouts)."""
        for part in (self.lm, self.vision):
            hook = None if part is None else getattr(part, "after_load", None)
            if hook is not None:
                hook()


TowerBuild = Callable[[ModelSpec, torch.dtype, torch.device, str], nn.Module]


class ModelBuild(Protocol):
    """A family's ``build``: (spec, tp, dtype, device, attn_backend) -> the model, its tower left out with
    ``vision=False``, its language model's linear and expert weights meta tensors with ``defer_lm_weights`` (filled
    by an FP8 checkpoint's streaming load, layers/deferred.py)."""

    def __call__(
        self, spec: ModelSpec, tp: TPGroup, dtype: torch.dtype, device: torch.device, attn_backend: str,
        *, vision: bool = True, defer_lm_weights: bool = False,
    ) -> VLModel: ...


@dataclass(frozen=True)
class ModelFamily:
    name: str  # the package name under workers/engine/models/
    parse: Callable[[dict[str, Any], Path], ModelSpec]
    build: ModelBuild
    positions: PositionsFn  # 3 x T position rows and the decode delta (model workers)
    delta: DeltaFn  # the decode delta alone, without building the rows (tokenizers)
    write_demo: Callable[[Path, str], Path]  # (existing directory, demo variant) -> that directory
    description: str = ""
    video_layout: VideoLayoutFn | None = None  # None: the family takes no video
    # The family's own image side for processors the Qwen-style path does not fit (Gemma 4's token budgets):
    # (transformers' processor, spec, resize pool, strips) -> an object with the FamilyImages interface of
    # prompt/processor.py; the pool (None: resize on the caller alone) and strip count are MMProcessor's.
    images: Callable[[Any, ModelSpec, Executor | None, int], Any] | None = None
    # With ``images``: (transformers' image processor, merge) -> the pixel_frames.FrameLayout that makes the uint8
    # frames its tokenizers write into rows on a model worker's device, or None. None: the Qwen-style layout_of.
    frame_layout: Callable[[Any, int], Any] | None = None
    # (spec, dtype, device, attn_backend) -> the vision tower alone, no language model: what an encoder worker
    # (--encoder-workers) runs. None: the family cannot serve split encoders.
    build_tower: TowerBuild | None = None


def tower_builder(build_tower: Callable[..., nn.Module]) -> TowerBuild:
    """A family's ``build_tower``: its vision tower allocated from the spec, on the vision attention kernel the
    device and backend allow. The model worker's ``build`` (``builder``) makes its tower the same way, so an encoder
    worker's tower computes what the model worker's would."""

    def build(spec: ModelSpec, dtype: torch.dtype, device: torch.device, attn_backend: str) -> nn.Module:
        tower_backend = "auto" if attn_backend in ("fa3", "fa4") else attn_backend
        vision = build_tower(spec.vision, dtype=dtype, device=device, attn_backend=tower_backend)
        if (packed := vision_kernel(attn_backend, device)) is not None:
            for module in vision.modules():  # full blocks on FA3 where the tower runs its CUDA path; windows: window_attention.py
                if isinstance(module, VisionAttention):
                    module.packed = packed
        return vision

    return build


def builder(build_lm: Callable[..., nn.Module], build_tower: Callable[..., nn.Module]) -> ModelBuild:
    """A family's ``build``: its LM and (unless ``vision=False``) its tower allocated from the spec, wrapped for the
    runner. Without the tower nothing of it is allocated: a split model worker (--encoder-workers) gives those bytes
    to its caches."""
    tower = tower_builder(build_tower)

    def build(
        spec: ModelSpec, tp: TPGroup, dtype: torch.dtype, device: torch.device, attn_backend: str,
        *, vision: bool = True, defer_lm_weights: bool = False,
    ) -> VLModel:
        with deferred_weights(defer_lm_weights):
            lm = build_lm(spec.text, tp=tp, dtype=dtype, device=device, attn_backend=attn_backend)
        return VLModel(spec, lm, tower(spec, dtype, device, attn_backend) if vision else None)

    return build
