"""What every process knows about a checkpoint: ``ModelSpec``, read once from its config.json by the family's
``parse`` (in the launcher, or by the offline Engine) and shipped down frozen inside ``EngineConfig``, with the
parts of it some families add (a hybrid model's recurrent state, a video's timing). ``spec_from`` reads the fields
every Qwen-style VLM spells the same way; the family's own text and vision specs ride inside, opaque to the rest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the launcher reads specs before any child: it never imports torch itself
    import torch


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
        return self.num_layers * (c * w + h * k * v) * dtype.itemsize


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
        return self.embed_width * dtype.itemsize

    def kv_cache_shapes(self, num_blocks: int, block_size: int, tp_size: int = 1) -> list[tuple[int, ...]]:
        """The shape of each paged-KV cache (``[2, num_blocks, block_size, kv_heads per rank, head_dim]``), in the
        LM's kv_caches order."""
        shapes = self.kv_shapes or ((self.num_kv_heads, self.head_dim),) * self.kv_layers
        return [(2, num_blocks, block_size, max(1, heads // tp_size), dim) for heads, dim in shapes]

    def kv_bytes_per_block(
        self, block_size: int, dtype: torch.dtype, tp_size: int = 1, windowed: bool | None = None
    ) -> int:
        """Bytes of one block over the caches; ``windowed``: only the windowed caches (True) or the others (False)."""
        element = dtype.itemsize
        shapes = self.kv_cache_shapes(1, block_size, tp_size)
        if windowed is not None and self.kv_windows is not None:
            shapes = [s for s, w in zip(shapes, self.kv_windows, strict=True) if (w > 0) == windowed]
        return sum(math.prod(shape) for shape in shapes) * element

    @property
    def window(self) -> int:
        """The sliding window of the windowed caches (their block pool frees what falls before it), 0: none."""
        return max(self.kv_windows, default=0) if self.kv_windows is not None else 0


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
    # transformers' order (GenerationConfig.from_model_config without generation_config.json): the root's ids,
    # then text_config's for what the root leaves unset (Gemma 4: root [1, 106] against text_config's 1).
    for source in (json.loads(gen_path.read_text()) if gen_path.exists() else {}, cfg, fields):
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
