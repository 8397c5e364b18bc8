"""What every family's decoder shares: its config fields, the pre-norm layer (rotary GQA attention over the paged
KV cache, SwiGLU MLP, residual adds deferred into the next norm), the vocab-parallel embedding and head, the
attention backend picked on the first forward, the layer loop, logits gathered over TP ranks, the paged KV cache's
shape, allocation straight in the target dtype, and loading canonical ``lm.*`` checkpoint tensors into fused,
sharded parameters.

A family's LM subclasses ``PagedDecoder``: it builds ``self.layers`` between ``super().__init__`` and
``self.add_head()``, then sets ``self.rotary`` (positions, dtype -> cos and sign-folded sin tables); it overrides
``forward`` where something joins the layer loop (Qwen3-VL's DeepStack), ``DecoderAttention.rotate`` where q and k
take more than rotary (Qwen3's q/k norms), and ``route`` / ``shards_needed`` where its checkpoint has more fused
layouts (Qwen3-VL-MoE's experts)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.kernels import fused, rope_kernel
from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.kernels.backends import get_attention_backend
from workers.engine.kernels.skinny_gemm import Partials, settled
from workers.engine.layers.linear import (
    SINGLE_RANK,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    get_weight_loader,
    kv_heads_per_rank,
)
from workers.engine.layers.rotary import apply_rope
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


@dataclass(frozen=True)
class DecoderSpec:
    """Shape and numerics of a decoder, read from a checkpoint's config.json (``decoder_fields`` plus the tie flag,
    which each family reads its own way); a family's TextSpec adds its own fields."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    tie_word_embeddings: bool
    max_position_embeddings: int


def decoder_fields(
    cfg: dict[str, Any],
    *,
    default_theta: float,
    default_section: tuple[int, ...],
    default_max_len: int,
    default_head_dim: int | None = None,
    default_eps: float = 1e-6,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The decoder fields a Qwen-style config.json spells alike, as (TextSpec fields, the LM's config section,
    its RoPE section). LM fields sit in ``text_config`` (transformers 5) or at the top level; RoPE in
    ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (older, type spelled "mrope").

    ``default_head_dim`` / ``default_eps``: the family's transformers config defaults where config.json omits the
    field (None: hidden_size / num_attention_heads, as transformers derives it for configs without a default)."""
    text = {**cfg, **(cfg.get("text_config") or {})}
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or default_head_dim or int(text["hidden_size"]) // heads)
    rope: dict[str, Any] = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise NotImplementedError(f"rope type {rope_type!r} is not supported (only plain M-RoPE)")
    section = tuple(int(s) for s in rope.get("mrope_section", default_section))
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {section} must be 3 sizes summing to head_dim/2 = {head_dim // 2}")
    if text.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {text['hidden_act']!r} is not supported")
    if text.get("use_sliding_window"):
        raise NotImplementedError("sliding-window attention layers are not supported")
    fields = {
        "hidden_size": int(text["hidden_size"]),
        "num_hidden_layers": int(text["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(text.get("num_key_value_heads") or heads),
        "head_dim": head_dim,
        "intermediate_size": int(text["intermediate_size"]),
        "vocab_size": int(text["vocab_size"]),
        "rms_norm_eps": float(text.get("rms_norm_eps", default_eps)),
        "rope_theta": float(rope.get("rope_theta", text.get("rope_theta", default_theta))),
        "mrope_section": section,
        "max_position_embeddings": int(text.get("max_position_embeddings", default_max_len)),
    }
    return fields, text, rope


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU MLP, gate and up fused into one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=False, tp=tp
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, tp=tp)
        self.fused = False  # CUDA: silu(gate) * up in one kernel (fused.fast_silu_mul)
        # Set by the layer whose next step is an RMSNorm.add: the down projection's split-K sum is left to it.
        self.into_norm = False

    def forward(self, x: Tensor) -> Tensor | Partials:
        # fused: a split-K gate_up's partials go to the SiLU kernel, which sums them (silu_kernel.py)
        return self.from_gate_up(self.gate_up_proj.unsummed(x) if self.fused else self.gate_up_proj(x))

    def from_gate_up(self, gate_up: Tensor | Partials) -> Tensor | Partials:
        """The MLP after its gate_up projection (a caller may have computed it inside a wider matmul); unsummed
        partials only where ``into_norm`` is set."""
        down = self.down_proj.into_norm if self.into_norm else self.down_proj
        if self.fused and fused.worth_it(gate_up):
            out: Tensor | Partials = down(fused.fast_silu_mul(gate_up))
            return out
        gate, up = settled(gate_up).chunk(2, dim=-1)
        result: Tensor | Partials = down(F.silu(gate) * up)
        return result


class DecoderAttention(nn.Module):
    """GQA self-attention over the paged KV cache: q, k and v in one column-parallel matmul (heads split over TP
    ranks), rotary from the per-forward tables, the output projection row-parallel."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        d = spec.head_dim
        self.head_dim = d
        heads, kv_heads = spec.num_attention_heads, spec.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, d, heads, kv_heads, bias=qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(heads * d, spec.hidden_size, bias=o_bias, tp=tp)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.scale = d**-0.5
        self.fused = False  # CUDA: rotary of q and k in one kernel (rope_kernel.py; compiled where it is off)

    def rotate(
        self, qkv: Tensor | Partials, cos: Tensor, sin: Tensor, cache: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The projection's output [T, q + 2 kv] -> q and k with rotary applied, and v, each [T, heads, D]; a
        split-K decode product's partials are summed by the rotary kernel (rope_kernel.py). ``cache`` (kv_cache and
        the slots ``rope_kernel.cache_slots`` gave): the kernel also writes k and v there."""
        d = self.head_dim
        if self.fused and fused.worth_it(qkv) and rope_kernel.wanted(qkv, d):
            return rope_kernel.lm_rope(qkv, cos, sin, self.q_size, self.kv_size, d, cache=cache)
        qkv = settled(qkv)
        t = qkv.shape[0]
        if self.fused and fused.worth_it(qkv):
            q, k, v = fused.compiled(fused.lm_rope)(qkv, cos, sin, self.q_size, self.kv_size, d)
            return q, k, v
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return apply_rope(q.view(t, -1, d), cos, sin), apply_rope(k.view(t, -1, d), cos, sin), v.view(t, -1, d)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> Tensor | Partials:
        """The attention's output for the layer's post-attention ``RMSNorm.add`` (a split-K o projection's partials
        are summed there)."""
        qkv = self.qkv_proj.unsummed(x) if self.fused else self.qkv_proj(x)
        # decode rows: the rotary kernel writes K/V into the cache, and the backend only attends
        slots = rope_kernel.cache_slots(qkv, self.head_dim, kv_cache, meta, backend) if self.fused else None
        q, k, v = self.rotate(qkv, cos, sin, None if slots is None else (kv_cache, slots))
        out = backend.forward(q, k, v, kv_cache, meta if slots is None else meta.written(), self.scale)
        return self.o_proj.into_norm(out.reshape(x.shape[0], -1))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention, then the MLP (dense or sparse), each behind an RMSNorm."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        sum_in_next_norm(mlp)

    def forward(
        self,
        h: Tensor,
        delta: Tensor | Partials | None,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[Tensor, Tensor | Partials]:
        """(residual stream, previous layer's MLP output or None) -> the same pair after this layer.

        The MLP output is added to the stream by the *next* norm (``RMSNorm.add``), so on CUDA each residual
        add shares a kernel with the norm after it; the ops and their order are transformers' either way. A
        decode step's split-K projections hand that norm their partials (skinny_gemm.Partials): ``settled`` gives
        a caller that needs the output itself its sum."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm.add(h, delta)
        h, x = self.post_attention_layernorm.add(h, self.self_attn(x, cos, sin, kv_cache, meta, backend))
        out: Tensor | Partials = self.mlp(x)
        return h, out


def sum_in_next_norm(mlp: nn.Module) -> None:
    """A dense MLP whose output goes straight to the next layer's ``RMSNorm.add`` leaves its down projection's split-K
    sum to that norm (a MoE block's output is summed over experts first, so it keeps its own)."""
    if isinstance(mlp, SwiGLUMLP):
        mlp.into_norm = True


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
