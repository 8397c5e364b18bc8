"""How a model worker sizes its caches out of memory (embedding store, KV blocks), and the linear-attention state
pools of hybrid models such as Qwen3.5: how many slots, their memory, and the copies between slots that the
scheduler plans.

Each linear-attention layer of the LM keeps two pools (``LanguageModel.allocate_state``): a conv window and a
recurrent matrix per slot. A slot is one running sequence's live state or a snapshot of some sequence's state at a
block boundary (the prefix cache on state, workers/engine/core/state_cache.py says which). Copying a slot copies it
in every pool: a request that resumes from a snapshot starts from a copy of it, an n > 1 choice from a copy of its
parent's. One slot past the scheduler's count is scratch (warm-up and padded rows write there).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from workers.engine.config import EngineConfig
from workers.engine.core.mm_cache import EmbeddingStore
from workers.engine.kernels import kv_quant
from workers.engine.kernels.attention import StateMetadata
from workers.engine.layers.linear import TPGroup
from workers.engine.models.kv_scales import load_kv_scales
from workers.engine.models.model_spec import ModelSpec, RecurrentSpec
from workers.engine.runner.host_embeddings import HostEmbeddings

log = logging.getLogger("glimpse.model")

# Without --state-slots: live states for every running sequence plus as many snapshots, if half the cache budget
# holds them (a Qwen3.5-27B slot is ~75 MB in bf16: 48 layers of 48 heads x 128 x 128); else what that half holds.
SLOTS_PER_SEQ = 2
STATE_SHARE = 0.5
# Without --num-window-blocks: twice what the running sequences' windows take, out of at most half the cache budget.
WINDOW_REUSE = 2
WINDOW_SHARE = 0.5


def embedding_store(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> EmbeddingStore:
    """On CUDA the embedding cache's whole budget is reserved now (see EmbeddingStore); on the CPU its entries are plain
    tensors, allocated as they come."""
    if device.type != "cuda" or cfg.mm_cache_mode != "image" or cfg.mm_cache_mb <= 0:
        return EmbeddingStore()
    return EmbeddingStore(int(cfg.mm_cache_mb * 2**20), spec.embed_width, dtype, device)


def host_embeddings(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> HostEmbeddings:
    """The embedding cache's host tier: its budget (EngineConfig.host_cache_bytes) reserved now, pinned on CUDA."""
    return HostEmbeddings(cfg.host_cache_bytes(), spec.embed_width, dtype, device)


def cache_budget(cfg: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV cache and a hybrid model's state pools: --kv-cache-mb, else 40% of the free GPU memory or
    512 MB on the CPU."""
    if cfg.kv_cache_mb is not None:
        return cfg.kv_cache_mb << 20
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.4)
    return 512 << 20


def num_kv_blocks(
    cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype, tp_size: int, budget: int, window_pool: bool = False
) -> int:
    """--num-kv-blocks, or as many blocks as ``budget`` bytes hold (``window_pool``: the windowed caches have a pool
    of their own, so a block costs only the global caches' bytes)."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    windowed = False if window_pool else None
    return max(1, budget // spec.kv_bytes_per_block(cfg.block_size, dtype, tp_size, windowed))


def num_window_blocks(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype, tp_size: int, budget: int) -> int:
    """Blocks of the sliding-window layers' own pool (0 without windowed caches): --num-window-blocks, else every
    running sequence's window plus a chunk (window_blocks.py's per-sequence bound), twice over so that released blocks
    stay prefix-cache hits for a while, and at most what WINDOW_SHARE of ``budget`` holds (one sequence's need at
    least); the rest of the budget is the global pool's. 0 (--num-window-blocks 0): no window pool, every layer keeps
    every block in the one pool."""
    if not spec.window:
        return 0
    if cfg.num_window_blocks is not None:
        return cfg.num_window_blocks
    chunk = max(cfg.chunk_size, cfg.lone_prefill_tokens)
    per_seq = -(-(spec.window + chunk) // cfg.block_size) + 1
    per_block = spec.kv_bytes_per_block(cfg.block_size, dtype, tp_size, windowed=True)
    cap = int(budget * WINDOW_SHARE) // per_block
    return max(per_seq, min(WINDOW_REUSE * cfg.max_num_seqs * per_seq, cap))


def state_slots(cfg: EngineConfig, recurrent: RecurrentSpec, budget: int, dtype: torch.dtype, tp_size: int) -> int:
    """Slots of the pool: ``--state-slots``, or as many as the rule above gives out of ``budget`` cache bytes."""
    if cfg.state_slots is not None:
        return cfg.state_slots
    per_slot = recurrent.bytes_per_slot(dtype, tp_size)
    return max(1, min(SLOTS_PER_SEQ * cfg.max_num_seqs, int(budget * STATE_SHARE) // per_slot))


class RecurrentState:
    """The pools of every linear-attention layer, allocated once at start-up."""

    def __init__(self, lm: Any, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        """``lm``: a hybrid family's language model (its ``allocate_state``)."""
        self.num_slots = num_slots
        self.scratch = num_slots
        self.device = device
        self.pools: list[Tensor] = lm.allocate_state(num_slots + 1, dtype)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.pools)
        log.info("linear-attention state: %d slots, %.1f MiB", num_slots, self.nbytes / 2**20)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slot ``src`` into slot ``dst`` in every pool, for each (src, dst); queued on the current stream."""
        pairs = [(a, b) for a, b in pairs if a != b]
        if not pairs:
            return
        index = torch.tensor([a for a, _ in pairs] + [b for _, b in pairs], device=self.device)
        src, dst = index.split(len(pairs))
        for pool in self.pools:
            pool[dst] = pool[src]  # the gather runs before the scatter: chains of pairs read the old contents

    def scratch_metadata(self, sequences: int, resumed: bool = False, snapshots: tuple[int, ...] = ()) -> StateMetadata:
        """Metadata that runs ``sequences`` sequences in the scratch slot (warm-up): from zero state, or ``resumed``
        from what the scratch slot holds; ``snapshots``: offsets into sequence 0 at which its state is copied to the
        scratch slot as well."""
        slots = [self.scratch] * sequences
        return StateMetadata(
            slots=torch.tensor(slots, device=self.device),
            slots_cpu=slots,
            has_initial=torch.full((sequences,), resumed, dtype=torch.bool, device=self.device),
            has_initial_cpu=[resumed] * sequences,
            snapshots=[(0, n, self.scratch) for n in snapshots],
        )


def allocate_kv_caches(
    spec: ModelSpec, model: Any, num_blocks: int, window_blocks: int, block_size: int, tp_size: int,
    dtype: torch.dtype, device: torch.device,
) -> list[Tensor]:
    """The LM's paged-KV caches, each with one block past the scheduler's count: block ``num_blocks`` (or
    ``window_blocks`` in the window pool) is scratch that CUDA-graph padding rows and released window-table entries
    point at, so they never touch a live sequence's cache. With a window pool the windowed caches hold
    ``window_blocks`` + 1 blocks, the others ``num_blocks`` + 1."""
    if spec.kv_shapes is not None:  # caches of several shapes (Gemma 4's sliding and global layers)
        shapes = spec.kv_cache_shapes(num_blocks + 1, block_size, tp_size)
    else:
        shapes = [model.kv_cache_shape(num_blocks + 1, block_size)] * spec.kv_layers
    if window_blocks and spec.kv_windows is not None:
        shapes = [(s[0], window_blocks + 1, *s[2:]) if w else s for s, w in zip(shapes, spec.kv_windows, strict=True)]
    return [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]


def attach_kv_scales(caches: list[Tensor], cfg: EngineConfig, spec: ModelSpec, tp: TPGroup) -> list[Tensor]:
    """``caches``, each FP8 one with its scales: this rank's heads of the checkpoint's (or 1.0; models/kv_scales.py)."""
    if not caches or not kv_quant.is_fp8(caches[0]):
        return caches
    scales = load_kv_scales(None if cfg.load_format == "dummy" else cfg.model, spec, tp.size, tp.rank)
    for cache, scale in zip(caches, scales, strict=True):
        kv_quant.attach_scales(cache, scale.to(cache.device))
    size = sum(c.numel() for c in caches) / 2**20
    log.info("KV cache in %s: %d caches, %.1f MiB", kv_quant.dtype_name(caches[0].dtype), len(caches), size)
    return caches


def copy_kv_blocks(
    caches: list[Tensor], windows: tuple[int, ...] | None, pairs: list[tuple[int, int]],
    window_pairs: list[tuple[int, int]], device: torch.device,
) -> None:
    """Copy KV blocks (src, dst) in every cache of their group (``windows``: each cache's window, a non-zero one
    takes ``window_pairs``; None: one group), queued on the current stream: one copy per cache for all pairs."""
    groups = {False: pairs, True: window_pairs}
    index = {key: torch.tensor([a for a, _ in p] + [b for _, b in p], device=device).split(len(p))
             for key, p in groups.items() if p}  # fmt: skip
    for i, kv in enumerate(caches):
        key = bool(windows[i]) if windows is not None else False
        if key in index:
            src, dst = index[key]
            kv = kv.view(torch.uint8) if kv_quant.is_fp8(kv) else kv  # bytes: not every device indexes e4m3
            kv[:, dst] = kv[:, src]
