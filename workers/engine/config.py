"""Engine configuration: one frozen, picklable object built in the parent and copied to every process."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

MMCacheMode = Literal["image", "request"]
LoadFormat = Literal["auto", "dummy"]


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine. ``model`` is a local Hugging Face checkpoint directory."""

    model: str
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    load_format: LoadFormat = "auto"
    attn_backend: Literal["auto", "sdpa", "flash"] = "auto"
    # Scheduling: per-step token budget shared by decodes and prefill chunks.
    chunk_size: int = 1024
    # Budget of a step in which no sequence is decoding (so no inter-token latency is at stake): a lone
    # prompt prefills in chunks this large. 0: chunk_size. `glimpse serve` defaults to 4096.
    lone_prefill_tokens: int = 0
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # Paged KV cache. num_kv_blocks wins over kv_cache_mb when both are set.
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_mb: int | None = None  # default: 512 on CPU, 40% of free memory on CUDA
    # Per-image embedding cache.
    mm_cache_mb: float = 1024  # fractions allowed (tests size the cache below one request)
    mm_cache_mode: MMCacheMode = "image"
    # A ViT call takes the step's images until this many patches (always at least one image). One 1080p image
    # (10,764 patches) already fills a GPU, so bigger calls buy nothing but a transient that grows with the
    # number of images a chunk happens to touch.
    vit_max_patches: int = 16384
    # CUDA: the elementwise work between GEMMs (norms, rotary, SiLU*up, residual adds) as torch.compile'd
    # kernels (workers/engine/fused.py), compiled at start-up; off = eager PyTorch ops. CPU is always eager.
    fused_kernels: bool = True
    # Share computed KV blocks between requests with the same prefix (a chat's earlier turns).
    enable_prefix_caching: bool = True
    seed: int = 0
    tp_size: int = 1

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


@dataclass(frozen=True)
class ModelInfo:
    """The few facts about a checkpoint that every process needs (read from config.json alone)."""

    image_token_id: int
    vision_start_token_id: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    spatial_merge_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @staticmethod
    def load(model_dir: str | Path) -> ModelInfo:
        path = Path(model_dir)
        cfg = json.loads((path / "config.json").read_text())
        # transformers 5 nests the LM fields under text_config; original Qwen checkpoints keep them top level.
        text = {**cfg, **cfg.get("text_config", {})}
        vision = cfg.get("vision_config", {})
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        eos: list[int] = []
        gen_path = path / "generation_config.json"
        for source in (json.loads(gen_path.read_text()) if gen_path.exists() else {}, text, cfg):
            value = source.get("eos_token_id")
            if value is not None:
                eos = [value] if isinstance(value, int) else list(value)
                break
        return ModelInfo(
            image_token_id=int(cfg.get("image_token_id", text.get("image_token_id", 151655))),
            vision_start_token_id=int(cfg.get("vision_start_token_id", text.get("vision_start_token_id", 151652))),
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_kv_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=head_dim,
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            eos_token_ids=tuple(int(t) for t in eos),
            raw=cfg,
        )

    def embedding_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one image token's embedding takes in the embedding cache."""
        return self.hidden_size * torch.empty((), dtype=dtype).element_size()

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
        kv_heads = max(1, self.num_kv_heads // tp_size)
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * kv_heads * self.head_dim * element
