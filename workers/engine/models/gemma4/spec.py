"""Gemma 4's text config, read from config.json: the sliding / full layer pattern and each kind's head shape, which
layers keep a KV cache and which read another layer's (``num_kv_shared_layers``), rotary per layer kind (plain for
sliding layers, "proportional" partial rotary for full ones), per-layer inputs (E2B / E4B), the MoE block beside the
dense MLP (26B-A4B) and the final logit softcap.

Field names and defaults are transformers' ``Gemma4TextConfig`` (5.24), including what its ``__post_init__`` derives:
the default 5:1 ``layer_types`` with the last layer forced to full attention, and ``per_layer_config`` built from
``global_head_dim`` / ``num_global_key_value_heads`` (Hub configs) unless the config already carries one (configs
saved by transformers). What transformers would read differently from what the checkpoint says, or what glimpse
does not serve (bidirectional text, attention biases, other activations or rope types), is refused with the field's
name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from workers.engine.models.model_spec import text_fields

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma4TextConfig's defaults where config.json omits a field.
DEFAULT_SLIDING_PATTERN = 6  # every 6th layer (1-based) full attention
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
# Gemma4Config's multimodal placeholder ids: transformers embeds them as the pad token (Gemma4Model.forward).
DEFAULT_PLACEHOLDERS = {"image_token_id": 258_880, "video_token_id": 258_884, "audio_token_id": 258_881}


@dataclass(frozen=True)
class RopeSpec:
    """One layer kind's rotary: "default" rotates every dim pair; "proportional" (full layers) rotates the first
    ``int(partial_rotary_factor * head_dim // 2)`` frequencies of the head's D/2 and leaves the rest (zero frequency:
    cos 1, sin 0), its exponents over the whole head_dim, all frequencies divided by ``factor``."""

    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def inv_freq(self, head_dim: int) -> Tensor:
        """float32 [head_dim / 2], as transformers' init functions compute them."""
        if self.rope_type == "default":
            return 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        angles = int(self.partial_rotary_factor * head_dim // 2)
        rotated = 1.0 / (
            self.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim)
        )
        nope = head_dim // 2 - angles
        inv = torch.cat((rotated, torch.zeros(nope, dtype=torch.float32))) if nope > 0 else rotated
        return inv / self.factor


@dataclass(frozen=True)
class TextSpec:
    """The decoder's shape and numerics. ``num_key_value_heads`` / ``head_dim`` are the config's top-level values (the
    sliding layers'); each layer's own are in ``layer_kv_heads`` / ``layer_head_dims``."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    pad_token_id: int
    layer_types: tuple[str, ...]
    layer_head_dims: tuple[int, ...]
    layer_kv_heads: tuple[int, ...]
    # Per layer: the layer whose K/V it attends over: itself, or (KV-shared layers) the last layer before the shared
    # ones with the same kind (transformers' "store" layer), whose cache already holds this step's K/V.
    kv_sources: tuple[int, ...]
    sliding_window: int
    sliding_rope: RopeSpec
    full_rope: RopeSpec
    attention_k_eq_v: bool = False  # full layers: no v_proj, V is K's projection (before K's norm and rotary)
    hidden_size_per_layer_input: int = 0  # per-layer inputs (PLE) width per layer; 0: none
    vocab_size_per_layer_input: int = 0
    use_double_wide_mlp: bool = False  # KV-shared layers' MLPs twice as wide
    num_experts: int = 0  # 0: dense; else every layer has routed experts beside its dense MLP
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    final_logit_softcapping: float | None = None
    bidirectional_vision: bool = False  # use_bidirectional_attention="vision": image tokens see each other (sliding)
    placeholder_token_ids: tuple[int, ...] = ()  # embedded as pad_token_id, as transformers does

    # ---- layers and caches --------------------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def owns_kv(self, layer: int) -> bool:
        return self.kv_sources[layer] == layer

    @property
    def kv_owner_layers(self) -> tuple[int, ...]:
        """The layers that keep a paged KV cache, in layer order (= the LM's kv_caches order)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.owns_kv(i))

    @property
    def kv_layers(self) -> int:
        return len(self.kv_owner_layers)

    def cache_index(self, layer: int) -> int:
        """Index in kv_caches of the cache ``layer`` attends over (its own, or its store layer's)."""
        return self.kv_owner_layers.index(self.kv_sources[layer])

    def kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """(num_kv_heads, head_dim) of each paged-KV cache at TP 1, in kv_caches order (ModelSpec.kv_shapes)."""
        return tuple((self.layer_kv_heads[i], self.layer_head_dims[i]) for i in self.kv_owner_layers)

    def window(self, layer: int) -> int:
        """The attention backend's ``window`` for this layer: the sliding window, 0 for full attention."""
        return self.sliding_window if self.is_sliding(layer) else 0

    def rope(self, kind: str) -> RopeSpec:
        return self.sliding_rope if kind == SLIDING else self.full_rope

    def mlp_width(self, layer: int) -> int:
        """transformers' Gemma4TextMLP: twice the width in KV-shared layers when ``use_double_wide_mlp``."""
        wide = self.use_double_wide_mlp and not self.owns_kv(layer)
        return self.intermediate_size * (2 if wide else 1)

    @property
    def per_layer_width(self) -> int:
        """Columns of the per-layer inputs riding beside each token row (all layers packed), 0 without PLE."""
        return self.num_hidden_layers * self.hidden_size_per_layer_input

    @property
    def token_row_width(self) -> int:
        """Width of ``embed_tokens``' rows: the hidden size, then the per-layer inputs' token-identity part."""
        return self.hidden_size + self.per_layer_width

    # ---- parsing ------------------------------------------------------------------------------------
    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> TextSpec:
        """The whole config.json (LM fields under ``text_config``) or the text fields alone."""
        text = text_fields(cfg)
        _refuse_unsupported(text)
        layers = int(text["num_hidden_layers"])
        kinds = _layer_types(text, layers)
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or 256)
        kv_heads = int(text.get("num_key_value_heads") or 4)
        k_eq_v = bool(text.get("attention_k_eq_v", False))
        head_dims, kv_per_layer = _per_layer_shapes(text, kinds, head_dim, kv_heads, k_eq_v)
        nested: dict[str, Any] = cfg.get("text_config") or {}
        # As for the Qwen families: transformers 5 reads the tie flag at the root; text_config decides only without one.
        tie = cfg["tie_word_embeddings"] if "tie_word_embeddings" in cfg else nested.get("tie_word_embeddings", True)
        vocab = int(text.get("vocab_size", 262_144))
        ple = int(text.get("hidden_size_per_layer_input") or 0)
        ple_vocab = int(text.get("vocab_size_per_layer_input") or vocab) if ple else 0
        if ple and ple_vocab < vocab:
            raise NotImplementedError(
                f"vocab_size_per_layer_input={ple_vocab} < vocab_size={vocab} is not supported (every token id must "
                "have a per-layer input row)"
            )
        softcap = text.get("final_logit_softcapping")
        rope = text.get("rope_parameters") or DEFAULT_ROPE
        pad = text.get("pad_token_id")
        spec = TextSpec(
            vocab_size=vocab,
            hidden_size=int(text.get("hidden_size", 2304)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(text.get("intermediate_size", 9216)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
            tie_word_embeddings=bool(tie),
            pad_token_id=int(pad) if pad is not None else 0,
            layer_types=kinds,
            layer_head_dims=head_dims,
            layer_kv_heads=kv_per_layer,
            kv_sources=_kv_sources(kinds, int(text.get("num_kv_shared_layers") or 0)),
            sliding_window=int(text.get("sliding_window", 512)),
            sliding_rope=_rope(rope, SLIDING) if SLIDING in kinds else RopeSpec("default", 10_000.0),
            full_rope=_rope(rope, FULL),
            attention_k_eq_v=k_eq_v,
            hidden_size_per_layer_input=ple,
            vocab_size_per_layer_input=ple_vocab,
            use_double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
            final_logit_softcapping=float(softcap) if softcap is not None else None,
            bidirectional_vision=text.get("use_bidirectional_attention") == "vision",
            placeholder_token_ids=tuple(
                int(cfg.get(name, default)) for name, default in DEFAULT_PLACEHOLDERS.items()
                if cfg.get(name, default) is not None
            ),
            **_moe_fields(text),
        )
        _check_shared_shapes(spec)
        return spec


def _refuse_unsupported(text: dict[str, Any]) -> None:
    act = text.get("hidden_activation", text.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise NotImplementedError(f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    if text.get("attention_bias"):
        raise NotImplementedError("attention_bias=true is not supported (no Gemma 4 checkpoint has it)")
    bidir = text.get("use_bidirectional_attention")
    if bidir not in (None, "vision"):
        raise NotImplementedError(f"use_bidirectional_attention={bidir!r} is not supported (only null or 'vision')")


def _layer_types(text: dict[str, Any], layers: int) -> tuple[str, ...]:
    """``layer_types`` as given, else transformers' default (every 6th layer full); as transformers does, the last
    layer is full attention whatever the list says."""
    given = text.get("layer_types")
    if given is None:
        given = [SLIDING if (i + 1) % DEFAULT_SLIDING_PATTERN else FULL for i in range(layers)]
    kinds = [str(k) for k in given]
    if len(kinds) != layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for num_hidden_layers={layers}")
    unknown = sorted(set(kinds) - {SLIDING, FULL})
    if unknown:
        raise NotImplementedError(f"layer_types {unknown} are not supported (only {SLIDING!r} and {FULL!r})")
    if kinds:
        kinds[-1] = FULL
    return tuple(kinds)


def _per_layer_shapes(
    text: dict[str, Any], kinds: tuple[str, ...], head_dim: int, kv_heads: int, k_eq_v: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's (head_dim, num_key_value_heads): the top-level ones, overridden per layer by ``per_layer_config``
    (saved by transformers, keys are layer indices) or, as Gemma4TextConfig builds it, on full layers by
    ``global_head_dim`` and (only with ``attention_k_eq_v``) ``num_global_key_value_heads``."""
    overrides: dict[int, dict[str, Any]]
    if text.get("per_layer_config") is not None:
        overrides = {int(k): dict(v or {}) for k, v in text["per_layer_config"].items()}
    else:
        full: dict[str, Any] = {"head_dim": int(text.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM)}
        global_kv = text.get("num_global_key_value_heads")
        if k_eq_v and global_kv is not None:
            full["num_key_value_heads"] = int(global_kv)
        overrides = {i: full for i, kind in enumerate(kinds) if kind == FULL}
    head_dims, kv = [], []
    for i in range(len(kinds)):
        layer = overrides.get(i, {})
        unknown = sorted(set(layer) - {"head_dim", "num_key_value_heads"})
        if unknown:
            raise NotImplementedError(f"per_layer_config overrides {unknown} of layer {i} are not supported")
        head_dims.append(int(layer.get("head_dim") or head_dim))
        kv.append(int(layer.get("num_key_value_heads") or kv_heads))
    for kind in set(kinds):  # rotary tables are per kind, as transformers builds them
        shapes = {(head_dims[i], kv[i]) for i, k in enumerate(kinds) if k == kind}
        if len(shapes) > 1:
            raise NotImplementedError(f"{kind} layers of different head shapes {sorted(shapes)} are not supported")
    return tuple(head_dims), tuple(kv)


def _kv_sources(kinds: tuple[str, ...], shared: int) -> tuple[int, ...]:
    """transformers' ``kv_sharing_modes``: the last ``shared`` layers reuse the K/V of the last earlier layer of their
    kind (its "store" layer); every other layer attends over its own."""
    layers = len(kinds)
    if not 0 <= shared < layers:
        raise ValueError(f"num_kv_shared_layers={shared} must be in 0..num_hidden_layers-1={layers - 1} (some layer "
                         "has to compute the K/V the shared ones read)")
    first = layers - shared
    store = {kind: i for i, kind in enumerate(kinds[:first])}  # the last of each kind wins
    missing = sorted(set(kinds[first:]) - set(store))
    if missing:
        raise ValueError(f"KV-shared layers of kind {missing} have no earlier layer of that kind to read K/V from")
    return tuple(i if i < first else store[kinds[i]] for i in range(layers))


def _rope(rope: dict[str, Any], kind: str) -> RopeSpec:
    params = rope.get(kind)
    if params is None:
        raise ValueError(f"rope_parameters has no {kind!r} entry")
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise NotImplementedError(f"{kind} rope type {rope_type!r} is not supported (only default and proportional)")
    return RopeSpec(
        rope_type=rope_type,
        theta=float(params["rope_theta"]),
        partial_rotary_factor=float(params.get("partial_rotary_factor") or 1.0),
        factor=float(params.get("factor") or 1.0),
    )


def _moe_fields(text: dict[str, Any]) -> dict[str, Any]:
    if not text.get("enable_moe_block"):
        return {}
    fields = {
        "num_experts": int(text.get("num_experts") or 0),
        "top_k_experts": int(text.get("top_k_experts") or 0),
        "moe_intermediate_size": int(text.get("moe_intermediate_size") or 0),
    }
    if fields["num_experts"] <= 0 or fields["moe_intermediate_size"] <= 0:
        raise ValueError("enable_moe_block needs num_experts > 0 and moe_intermediate_size > 0")
    if not 0 < fields["top_k_experts"] <= fields["num_experts"]:
        raise ValueError(f"top_k_experts={fields['top_k_experts']} must be in 1..num_experts={fields['num_experts']}")
    return fields


def _check_shared_shapes(spec: TextSpec) -> None:
    for i, src in enumerate(spec.kv_sources):
        if (spec.layer_kv_heads[i], spec.layer_head_dims[i]) != (spec.layer_kv_heads[src], spec.layer_head_dims[src]):
            raise ValueError(f"layer {i} reads layer {src}'s KV cache but their head shapes differ")
        if spec.num_attention_heads % spec.layer_kv_heads[i]:
            raise ValueError(f"num_attention_heads={spec.num_attention_heads} is not a multiple of layer {i}'s "
                             f"{spec.layer_kv_heads[i]} KV heads")


def check_tp(spec: TextSpec, tp_size: int) -> None:
    """Raise a ValueError naming every field that does not split evenly over ``tp_size`` ranks (query heads, MLP and
    expert widths); KV heads of each kind may also be fewer than the ranks (each then replicated)."""
    if tp_size == 1:
        return
    fields = {"num_attention_heads": spec.num_attention_heads, "intermediate_size": spec.intermediate_size}
    if spec.num_experts:
        fields["moe_intermediate_size"] = spec.moe_intermediate_size
    bad = [f"{name}={value}" for name, value in fields.items() if value % tp_size]
    for kind in sorted(set(spec.layer_types)):
        kv = spec.layer_kv_heads[spec.layer_types.index(kind)]
        if (kv % tp_size) if kv >= tp_size else (tp_size % kv):
            bad.append(f"{kind} KV heads={kv} (neither a multiple nor a divisor of it)")
    if bad:
        raise ValueError(f"this Gemma 4 checkpoint does not split over tensor-parallel size {tp_size}: {', '.join(bad)}")
