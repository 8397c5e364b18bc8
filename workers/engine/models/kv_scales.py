"""The FP8 KV cache's scales: from the checkpoint where it carries them, else 1.0, one per KV head of each cache.

Names read (canonical ``lm.layers.N.self_attn.`` + suffix; the ones vLLM maps onto its attention layer's
``k_scale`` / ``v_scale``):
* ``k_scale`` / ``v_scale``, also under ``attn.`` (vLLM's own layout; AutoFP8, ModelOpt exports);
* ``kv_scale``: one scale for both (older AutoFP8 checkpoints);
* ``k_proj.output_scale`` / ``v_proj.output_scale`` (llm-compressor's compressed-tensors ``kv_cache_scheme``).
A scalar is a per-tensor scale (the same in every head); a vector of ``num_key_value_heads`` is per head (llm-compressor's
``attn_head`` strategy). Each rank keeps its own heads' entries (a replicated head: its one head's).

Without scales in the checkpoint every scale is 1.0, vLLM's default: e4m3 keeps ~2 significant digits over
2^-9..448, and K/V after the projection, norm and rotary sit well inside that. No per-head scale is derived from
the data at run time: a scale computed from whichever requests came first would make the same prompt's cached
blocks differ between server runs, and the scale would have to stay fixed after the first write anyway.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from workers.engine.layers.linear import kv_heads_per_rank
from workers.engine.models.loader import iter_safetensors, normalize_name

if TYPE_CHECKING:  # decoder.py imports scale_name, and models.base's import chain is not needed for that
    from workers.engine.models.model_spec import ModelSpec

log = logging.getLogger("glimpse.model")

_NAME = re.compile(
    r"lm\.layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)$"
)


def scale_name(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") for a checkpoint tensor that is a KV-cache scale (stored name), else None."""
    match = _NAME.match(normalize_name(name))
    if match is None:
        return None
    return int(match.group(1)), match.group(2) or match.group(3)


def cache_layers(spec: ModelSpec) -> list[int]:
    """The layer owning each paged-KV cache, in kv_caches order: Gemma 4's KV-owner layers (its shared layers read
    their owner's cache, so take its scales), Qwen3.5's full-attention layers, else every layer."""
    owners = getattr(spec.text, "kv_owner_layers", None)
    if owners is None and spec.recurrent is not None:
        owners = spec.text.full_layers
    return list(owners) if owners is not None else list(range(spec.kv_layers))


def _rank_heads(values: Tensor, heads: int, tp_size: int, rank: int) -> Tensor:
    """One rank's entries of a per-head scale vector (the same rule as QKVParallelLinear's KV heads)."""
    local = kv_heads_per_rank(heads, tp_size)
    start = rank * local if heads >= tp_size else rank * heads // tp_size
    return values[start : start + local]


def load_kv_scales(
    model_dir: str | Path | None, spec: ModelSpec, tp_size: int = 1, rank: int = 0
) -> list[Tensor]:
    """Float32 [2, kv heads on this rank] per cache (row 0 K, row 1 V), on the CPU. ``model_dir`` None (dummy
    weights): all 1.0."""
    shapes = spec.kv_shapes or ((spec.num_kv_heads, spec.head_dim),) * spec.kv_layers
    owners = cache_layers(spec)
    found: dict[tuple[int, str], Tensor] = {}
    if model_dir is not None:
        for name, tensor in iter_safetensors(model_dir, lambda n: scale_name(n) is not None):
            parsed = scale_name(name)
            assert parsed is not None
            found[parsed] = tensor.float().flatten()
    scales = []
    for cache, (layer, (heads, _)) in enumerate(zip(owners, shapes, strict=True)):
        rows = []
        for side in ("k", "v"):
            value = found.get((layer, side), found.get((layer, "kv"), torch.ones(1)))
            if value.numel() == 1:
                value = value.expand(heads)
            elif value.numel() != heads:
                raise ValueError(f"layer {layer}'s {side}_scale has {value.numel()} entries; expected 1 or {heads} "
                                 f"(one per KV head)")
            rows.append(_rank_heads(value, heads, tp_size, rank))
        scales.append(torch.stack(rows).float().contiguous())
        if cache == 0 and found:
            log.info("FP8 KV cache scales from the checkpoint (%d tensors)", len(found))
    if not found:
        log.info("FP8 KV cache scales: 1.0 (the checkpoint carries none)")
    return scales
