"""transformers' model as the FP8 KV cache's reference: its language model's attention sees K and V rounded through
e4m3 with the cache's scale, and nothing else changes.

While it generates, transformers' own SDPA attention function is wrapped (an override of the ``sdpa`` entry in its
attention registry, ``ALL_ATTENTION_FUNCTIONS``, so every other choice transformers makes for SDPA, its masks
and caches, stays as it is): the wrapper receives K and V after the projection, the norms and rotary, the past
ones read from transformers' cache (Gemma 4's KV-shared layers: their store layer's), and rounds them before SDPA.
Rounding is idempotent, so rounding the whole K/V every step equals rounding each token once when it is written,
which is what the engine's cache does. The towers' attention (classes named ``*Vision*``/``*Audio*``) passes
through unchanged. Written apart from workers/engine/kernels/kv_quant.py on purpose: the test compares two
implementations, not one with itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tests.workers.engine.models.engine_harness import MAX_NEW, Reference


def e4m3_round_trip(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x / scale saturated at e4m3's +-448, rounded to e4m3, times scale (in x's dtype)."""
    return ((x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)) * scale


class Fp8KVAttention:
    """SDPA over rounded K/V for the LM's attention modules; counts the calls it rounded. ``per_head``: layer index
    -> float32 [2, kv heads] (K row, V row) scales, for layers without KV sharing; others use ``scale``."""

    def __init__(self, scale: float = 1.0, per_head: dict[int, torch.Tensor] | None = None) -> None:
        self.scale, self.per_head, self.rounded = scale, per_head or {}, 0

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                 **kwargs: Any) -> Any:
        name = type(module).__name__
        if "Vision" not in name and "Audio" not in name:
            scales = self.per_head.get(module.layer_idx)
            if scales is None:
                key, value = e4m3_round_trip(key, self.scale), e4m3_round_trip(value, self.scale)
            else:  # key, value: [batch, kv heads, tokens, D]
                key = e4m3_round_trip(key, scales[0].view(1, -1, 1, 1))
                value = e4m3_round_trip(value, scales[1].view(1, -1, 1, 1))
            self.rounded += 1
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


@contextmanager
def rounded_kv(attention: Fp8KVAttention) -> Iterator[None]:
    """transformers' ``sdpa`` is ``attention`` inside the block (a local override, removed after)."""
    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


class Fp8Reference(Reference):
    """``Reference`` whose LM attends over e4m3-rounded K/V: per-tensor scale 1.0 (the engine's default without
    checkpoint scales), or ``per_head`` scales of some layers."""

    def __init__(self, model_dir: Path, per_head: dict[int, torch.Tensor] | None = None) -> None:
        super().__init__(model_dir)
        self.model.set_attn_implementation("sdpa")
        self.attention = Fp8KVAttention(1.0, per_head)

    def generate(self, messages: list[dict[str, Any]], max_new: int = MAX_NEW) -> list[int]:
        with rounded_kv(self.attention):
            return super().generate(messages, max_new)

    def plain(self, messages: list[dict[str, Any]]) -> list[int]:
        """The same generate with SDPA unrounded (to show the rounding changes the answer)."""
        return super().generate(messages)
