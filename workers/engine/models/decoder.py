"""What every family's decoder shares around its layers (decoder_layers.py): the vocab-parallel embedding and head,
the attention backend picked on the first forward, the layer loop, logits gathered over TP ranks, the paged KV
cache's shape, allocation straight in the target dtype, and loading canonical ``lm.*`` checkpoint tensors into fused,
sharded parameters.

A family's LM subclasses ``PagedDecoder``: it builds ``self.layers`` between ``super().__init__`` and
``self.add_head()``, then sets ``self.rotary`` (positions, dtype -> cos and sign-folded sin tables); it overrides
``forward`` where something joins the layer loop (Qwen3-VL's DeepStack), ``DecoderAttention.rotate`` where q and k
take more than rotary (Qwen3's q/k norms), and ``route`` / ``shards_needed`` where its checkpoint has more fused
layouts (Qwen3-VL-MoE's experts)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Self, TypeVar

import torch
from torch import Tensor, nn

from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.kernels.backends import get_attention_backend
from workers.engine.kernels.skinny_gemm import Partials
from workers.engine.layers.linear import (
    SINGLE_RANK,
    ParallelLMHead,
    RMSNorm,
    TPGroup,
    VocabParallelEmbedding,
    get_weight_loader,
    kv_heads_per_rank,
)
from workers.engine.models.kv_scales import scale_name

M = TypeVar("M", bound=nn.Module)

# Checkpoint projections that live inside a fused parameter: (checkpoint part, fused part, shard_id).
FUSED_PROJECTIONS: tuple[tuple[str, str, str | int], ...] = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
)


class PagedDecoder(nn.Module):
    """Base of a decoder over a flattened batch of new tokens with a paged KV cache.

    ``embed_tokens`` maps ids [T] -> [T, H] (vocab-parallel); ``rotary`` maps (positions [3, T], dtype) to the
    cos and sign-folded sin tables [T, 1, D] every layer's attention takes."""

    layers: nn.ModuleList
    rotary: nn.Module

    def __init__(
        self, spec: Any, tp: TPGroup, attn_backend: str, embed_tokens: VocabParallelEmbedding | None = None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.attn_backend_name = attn_backend
        self._backend: AttentionBackend | None = None  # resolved on first forward, from the input's device
        # A family's own token embedding (Gemma 4's scaled rows with per-layer inputs), else the plain vocab-parallel one.
        self.embed_tokens = embed_tokens or VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.num_kv_heads_local = kv_heads_per_rank(spec.num_key_value_heads, tp.size)
        self.head_dim = spec.head_dim
        self._loaded: dict[str, set[object]] = {}  # parameter -> shard ids loaded so far

    @classmethod
    def build(
        cls,
        spec: Any,
        *,
        tp: TPGroup = SINGLE_RANK,
        dtype: torch.dtype,
        device: torch.device | str,
        attn_backend: str = "auto",
    ) -> Self:
        """The LM allocated on ``device`` in ``dtype``, weights uninitialised (``load_weights`` fills them; see
        models.load.load_model)."""
        return allocate(lambda: cls(spec, tp, attn_backend), dtype, device)

    def add_head(self) -> None:
        """The final norm and the LM head (after the layers, so parameters keep the checkpoint's order)."""
        spec = self.spec
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, self.tp)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # same vocab sharding, so one shard serves both

    def attention_backend(self, device: torch.device) -> AttentionBackend:
        if self._backend is None:
            self._backend = get_attention_backend(self.attn_backend_name, device)
        return self._backend

    def check_kv_caches(self, kv_caches: list[Tensor]) -> None:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")

    def final_norm(self, h: Tensor, delta: Tensor | Partials | None) -> Tensor:
        out: Tensor = self.norm(h) if delta is None else self.norm.add(h, delta)[1]
        return out

    def prepare(
        self, inputs_embeds: Tensor, positions: Tensor, kv_caches: list[Tensor], backend: AttentionBackend | None
    ) -> tuple[AttentionBackend, Tensor, Tensor]:
        """What every layer of one forward takes: the attention backend (``backend`` if given) and the rotary
        tables, built once for all layers."""
        self.check_kv_caches(kv_caches)
        backend = backend or self.attention_backend(inputs_embeds.device)
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        return backend, cos, sin

    def forward(
        self,
        inputs_embeds: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend | None = None,
        deepstack: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """inputs_embeds [T, H], positions int64 [3, T] (t/h/w rows) -> final-norm hidden states [T, H].

        ``backend`` overrides the model's attention backend for this call (CUDA-graph decode uses a fixed-shape
        one). ``deepstack`` is for families that take DeepStack features (and override this method)."""
        if deepstack is not None:
            raise ValueError(f"{type(self).__name__} takes no DeepStack features")
        backend, cos, sin = self.prepare(inputs_embeds, positions, kv_caches, backend)
        h, delta = inputs_embeds, None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, delta = layer(h, delta, cos, sin, kv_cache, meta, backend)
        return self.final_norm(h, delta)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, H] -> float32 logits [N, vocab], gathered over TP ranks (every rank gets all)."""
        local = self.lm_head(hidden)
        full = self.tp.all_gather(local, dim=-1)[..., : self.spec.vocab_size]
        return full.float()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's KV cache shape on this rank: [2, num_blocks, block_size, kv_heads_local, head_dim]."""
        return (2, num_blocks, block_size, self.num_kv_heads_local, self.head_dim)

    # ---- weights ----------------------------------------------------------------------------------
    def route(self, name: str) -> tuple[str, object]:
        """Checkpoint name (without ``lm.``) -> (parameter name, shard id for its weight loader)."""
        for part, fused_part, shard_id in FUSED_PROJECTIONS:
            if part in name:
                return name.replace(part, fused_part), shard_id
        return name, None

    def shards_needed(self, param: str) -> int:
        return 3 if ".qkv_proj." in param else 2 if ".gate_up_proj." in param else 1

    def unused(self, name: str) -> bool:
        """Checkpoint tensors (without ``lm.``) the model skips: a tied head's copy (some exports store one)."""
        return name == "lm_head.weight" and bool(self.spec.tie_word_embeddings)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]], partial: bool = False) -> set[str]:
        """Load canonical ``lm.*`` tensors (see loader.normalize_name); other names are ignored.

        Returns the parameter names loaded by this call. Unless ``partial`` (more calls follow, then
        ``check_loaded``), raises if any parameter or shard is still missing."""
        names: set[str] = set()
        for canonical, tensor in weights:
            if not canonical.startswith("lm."):
                continue
            name = canonical[len("lm.") :]
            if self.unused(name) or scale_name(canonical) is not None:  # KV-cache scales: models/kv_scales.py
                continue
            name, shard_id = self.route(name)
            # Looked up at each tensor: an FP8 checkpoint's streaming load replaces parameters as it goes
            # (layers/deferred.py).
            try:
                param = self.get_parameter(name)
            except AttributeError:
                raise KeyError(f"checkpoint tensor {canonical!r} has no matching parameter ({name!r})") from None
            get_weight_loader(param)(param, tensor, shard_id)
            self._loaded.setdefault(name, set()).add(shard_id)
            names.add(name)
        if not partial:
            self.check_loaded()
        return names

    def check_loaded(self) -> None:
        """Raise, naming them, if parameters (or shards of fused ones) were never loaded; a tensor loaded with
        shard id None filled its parameter whole."""
        missing = []
        for name, _ in self.named_parameters():
            got = self._loaded.get(name, set())
            if len(got) < self.shards_needed(name) and None not in got:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint lacks language-model weights for: {missing[:8]}")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are allocated directly in the target dtype, so a 30B model never exists in float32.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def allocate(factory: Callable[[], M], dtype: torch.dtype, device: torch.device | str) -> M:
    """``factory()`` built on ``device`` in ``dtype`` (weights uninitialised), in eval mode."""
    with default_dtype(dtype), torch.device(device):
        model = factory()
    return model.eval()
