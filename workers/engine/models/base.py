"""The model seam: what a family package provides and the one interface the runner, CUDA graphs, TP,
scheduler and caches see.

A family package (``workers/engine/models/<family>/``) exports ``FAMILY``, a ``ModelFamily``:
- ``parse(config_json, model_dir) -> ModelSpec``: every fact the other processes need, read once (in the
  launcher, or by the offline Engine) and shipped down frozen inside ``EngineConfig``;
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

import json
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.kernels.backends import vision_kernel
from workers.engine.layers.linear import TPGroup
from workers.engine.layers.vision_attention import VisionAttention

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


@dataclass(frozen=True)
class VideoTiming:
    """When a video's sampled frames were shown: what a family needs to lay the video out in a prompt."""

    frames_indices: tuple[int, ...]  # sampled frame numbers, ascending (the video processor's sample_frames)
    fps: float  # the video's frame rate
    total_frames: int
    temporal_patch: int  # frames per group

    @property
    def num_groups(self) -> int:
        return -(-len(self.frames_indices) // self.temporal_patch)


# (spec, timing, (video pad, vision start, vision end) token strings) -> (the text that replaces the video's
# placeholder token in the prompt, holding one video pad per frame group; each group's temporal offset).
VideoLayoutFn = Callable[["ModelSpec", VideoTiming, tuple[str, str, str]], tuple[str, list[int]]]


@dataclass(frozen=True)
class RecurrentSpec:
    """A hybrid model's linear-attention layers (e.g. Gated DeltaNet): the per-sequence state each of them keeps,
    at TP 1 (``bytes_per_slot`` divides the heads over ranks). One slot of the state pool holds one sequence's
    state in every such layer: a conv window of ``conv_kernel - 1`` inputs over the q, k and v channels, and a
    [key_head_dim, value_head_dim] recurrent matrix per value head."""

    num_layers: int  # layers with linear attention (the rest keep paged KV)
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    def conv_shape(self, tp_size: int = 1) -> tuple[int, int]:
        """One slot's conv window in one layer on one rank: [channels, conv_kernel - 1]."""
        return self.conv_dim // tp_size, self.conv_kernel - 1

    def ssm_shape(self, tp_size: int = 1) -> tuple[int, int, int]:
        """One slot's recurrent state in one layer on one rank: [value heads, key_head_dim, value_head_dim]."""
        return self.num_value_heads // tp_size, self.key_head_dim, self.value_head_dim

    def bytes_per_slot(self, dtype: torch.dtype, tp_size: int = 1) -> int:
        c, w = self.conv_shape(tp_size)
        h, k, v = self.ssm_shape(tp_size)
        return self.num_layers * (c * w + h * k * v) * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ModelSpec:
    """What every process needs to know about a checkpoint: family-agnostic facts plus the family's own
    frozen text and vision specs (opaque to everything outside the family package)."""

    family: str
    architecture: str
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    spatial_merge_size: int
    num_heads: int  # query heads of the decoder's attention
    patch_dim: int  # width of one pixel_values row (channels * temporal_patch * patch**2)
    embed_width: int  # columns of one image token's entry in the embedding cache (main + DeepStack levels)
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    text: Any  # the family's frozen text-model spec
    vision: Any  # the family's frozen vision-tower spec
    recurrent: RecurrentSpec | None = None  # hybrid models: the linear-attention layers' state (None: all attention)
    # Families whose KV layers differ in shape (Gemma 4: sliding layers and global layers have other head dims and
    # KV head counts): (num_kv_heads, head_dim) of each paged-KV cache, in the LM's kv_caches order. None: every
    # cache is (num_kv_heads, head_dim).
    kv_shapes: tuple[tuple[int, int], ...] | None = None
    # Families with sliding-window layers (Gemma 4): each paged-KV cache's window in kv_caches order (0: a global
    # cache). The windowed caches live in a block pool of their own, indexed by each sequence's window table
    # (workers/engine/core/window_blocks.py). None: one pool for every cache.
    kv_windows: tuple[int, ...] | None = None
    # The tokens of one image attend to each other both ways (Gemma 4's sliding layers): the scheduler never ends
    # a prefill chunk inside an image's span, so a chunk always holds every uncomputed token of an image it starts.
    bidirectional_images: bool = False

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model). Every family's text spec names them ``num_experts``."""
        return int(getattr(self.text, "num_experts", 0) or 0)

    @property
    def kv_layers(self) -> int:
        """Layers with a paged KV cache of their own (all of them, unless some keep recurrent state instead or read
        another layer's cache, as Gemma 4's KV-shared layers do)."""
        if self.kv_shapes is not None:
            return len(self.kv_shapes)
        return self.num_layers - (self.recurrent.num_layers if self.recurrent is not None else 0)

    def tokens_for_grid(self, grid: Sequence[int]) -> int:
        """LM tokens of one image with this (t, h, w) patch grid."""
        t, h, w = grid
        return t * h * w // (self.spatial_merge_size**2)

    def embedding_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one image token takes in the embedding cache (every DeepStack level included)."""
        return self.embed_width * torch.empty((), dtype=dtype).element_size()

    def kv_cache_shapes(self, num_blocks: int, block_size: int, tp_size: int = 1) -> list[tuple[int, ...]]:
        """The shape of each paged-KV cache (``[2, num_blocks, block_size, kv_heads per rank, head_dim]``), in the
        LM's kv_caches order."""
        shapes = self.kv_shapes or ((self.num_kv_heads, self.head_dim),) * self.kv_layers
        return [(2, num_blocks, block_size, max(1, heads // tp_size), dim) for heads, dim in shapes]

    def kv_bytes_per_block(
        self, block_size: int, dtype: torch.dtype, tp_size: int = 1, windowed: bool | None = None
    ) -> int:
        """Bytes of one block over the caches; ``windowed``: only the windowed caches (True) or the others (False)."""
        element = torch.empty((), dtype=dtype).element_size()
        shapes = self.kv_cache_shapes(1, block_size, tp_size)
        if windowed is not None and self.kv_windows is not None:
            shapes = [s for s, w in zip(shapes, self.kv_windows, strict=True) if (w > 0) == windowed]
        return sum(math.prod(shape) for shape in shapes) * element

    @property
    def window(self) -> int:
        """The sliding window of the windowed caches (their block pool frees what falls before it), 0: none."""
        return max(self.kv_windows, default=0) if self.kv_windows is not None else 0


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
    ``vision=False``."""

    def __call__(
        self, spec: ModelSpec, tp: TPGroup, dtype: torch.dtype, device: torch.device, attn_backend: str,
        *, vision: bool = True,
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
    # (transformers' processor, spec) -> an object with the FamilyImages interface of prompt/processor.py.
    images: Callable[[Any, ModelSpec], Any] | None = None
    # With ``images``: (transformers' image processor, merge) -> the pixel_frames.FrameLayout that makes the uint8
    # frames its tokenizers write into rows on a model worker's device, or None. None: the Qwen-style layout_of.
    frame_layout: Callable[[Any, int], Any] | None = None
    # (spec, dtype, device, attn_backend) -> the vision tower alone, no language model: what an encoder worker
    # (--encoder-workers) runs. None: the family cannot serve split encoders.
    build_tower: TowerBuild | None = None


def text_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: transformers 5 nests them under ``text_config``, original Qwen
    checkpoints keep them at the top level."""
    return {**cfg, **(cfg.get("text_config") or {})}


def spec_from(
    family: str,
    cfg: dict[str, Any],
    model_dir: Path,
    text: Any,
    vision: Any,
    embed_width: int,
    recurrent: RecurrentSpec | None = None,
) -> ModelSpec:
    """A family's ModelSpec from its parsed text and vision specs (Qwen-style field names) plus what every
    Qwen-style VLM spells the same way in config.json: special token ids, stop ids, architecture."""
    fields = text_fields(cfg)
    eos: list[int] = []
    gen_path = model_dir / "generation_config.json"
    for source in (json.loads(gen_path.read_text()) if gen_path.exists() else {}, fields, cfg):
        value = source.get("eos_token_id")
        if value is not None:
            eos = [value] if isinstance(value, int) else list(value)
            break

    def token(name: str, default: int) -> int:
        return int(cfg.get(name, fields.get(name, default)))

    return ModelSpec(
        family=family,
        architecture=(cfg.get("architectures") or ["?"])[0],
        image_token_id=token("image_token_id", 151655),
        video_token_id=token("video_token_id", 151656),
        vision_start_token_id=token("vision_start_token_id", 151652),
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers,
        num_kv_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        spatial_merge_size=vision.spatial_merge_size,
        num_heads=text.num_attention_heads,
        patch_dim=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
        embed_width=embed_width,
        max_position_embeddings=text.max_position_embeddings,
        eos_token_ids=tuple(int(t) for t in eos),
        text=text,
        vision=vision,
        recurrent=recurrent,
    )


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
        *, vision: bool = True,
    ) -> VLModel:
        lm = build_lm(spec.text, tp=tp, dtype=dtype, device=device, attn_backend=attn_backend)
        return VLModel(spec, lm, tower(spec, dtype, device, attn_backend) if vision else None)

    return build
