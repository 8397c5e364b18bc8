"""Qwen3.5's text config, read from config.json: the hybrid layer pattern (``layer_types``), the full-attention
layers' shape and partial interleaved M-RoPE, the Gated DeltaNet layers' heads and conv kernel, and (Qwen3.5-MoE)
the routed experts beside a gated shared expert.

Field names and defaults are transformers' ``Qwen3_5TextConfig`` / ``Qwen3_5MoeTextConfig``. What transformers would
silently read differently from what the checkpoint says (an ungated attention output, unnormalised routing, dense
layers in a MoE model, contiguous M-RoPE) is refused here with the field's name, rather than served wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.engine.models.decoder_spec import DecoderSpec
from workers.engine.models.model_spec import RecurrentSpec, text_fields

LINEAR, FULL = "linear_attention", "full_attention"
# transformers' defaults where config.json omits a field (Qwen3_5TextConfig; its rotary's mrope_section default).
DEFAULT_INTERVAL = 4
DEFAULT_HEAD_DIM = 256  # not hidden_size / num_attention_heads: transformers' field default
DEFAULT_PARTIAL_ROTARY = 0.25
DEFAULT_SECTION = (11, 11, 10)


@dataclass(frozen=True)
class TextSpec(DecoderSpec):
    """The decoder's shape and numerics. ``num_attention_heads`` / ``num_key_value_heads`` / ``head_dim`` are the
    full-attention layers'; the ``linear_*`` fields the Gated DeltaNet layers'."""

    layer_types: tuple[str, ...] = ()
    rotary_dim: int = 0  # leading dims of each q/k head that take rotary (head_dim * partial_rotary_factor)
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 0  # 0: dense (Qwen3.5); else every layer's MLP is sparse (Qwen3.5-MoE)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def full_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == FULL]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == LINEAR]

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> TextSpec:
        """The whole config.json (LM fields under ``text_config``, transformers 5) or the text fields alone."""
        text = text_fields(cfg)
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or DEFAULT_HEAD_DIM)
        layers = int(text["num_hidden_layers"])
        if text.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {text['hidden_act']!r} is not supported (only silu)")
        if text.get("attention_bias"):
            raise NotImplementedError("attention_bias=true is not supported (no Qwen3.5 checkpoint has it)")
        if text.get("attn_output_gate") is False:
            raise NotImplementedError("attn_output_gate=false is not supported (Qwen3.5 gates every attention output)")
        nested: dict[str, Any] = cfg.get("text_config") or {}
        # As for Qwen3-VL: transformers 5 reads the tie flag at the root; text_config decides only without one.
        tie = cfg["tie_word_embeddings"] if "tie_word_embeddings" in cfg else nested.get("tie_word_embeddings")
        rope_theta, section, rotary_dim = _rope(text, head_dim)
        linear = {
            "linear_num_key_heads": int(text.get("linear_num_key_heads", 16)),
            "linear_num_value_heads": int(text.get("linear_num_value_heads", 32)),
            "linear_key_head_dim": int(text.get("linear_key_head_dim", 128)),
            "linear_value_head_dim": int(text.get("linear_value_head_dim", 128)),
            "linear_conv_kernel_dim": int(text.get("linear_conv_kernel_dim", 4)),
        }
        if linear["linear_num_value_heads"] % linear["linear_num_key_heads"]:
            raise ValueError(
                f"linear_num_value_heads {linear['linear_num_value_heads']} must be a multiple of "
                f"linear_num_key_heads {linear['linear_num_key_heads']} (each key head serves whole value heads)"
            )
        if linear["linear_conv_kernel_dim"] < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {linear['linear_conv_kernel_dim']}")
        moe = _moe_fields(text)
        return TextSpec(
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            # Qwen3.5-MoE has no dense MLP; its shared expert's width stands in (unused by the decoder).
            intermediate_size=int(text.get("intermediate_size") or moe.get("shared_expert_intermediate_size", 0)),
            vocab_size=int(text["vocab_size"]),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            mrope_section=section,
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            layer_types=_layer_types(text, layers),
            rotary_dim=rotary_dim,
            **linear,
            **moe,
        )


def _layer_types(text: dict[str, Any], layers: int) -> tuple[str, ...]:
    """``layer_types`` as given, else transformers' default: every ``full_attention_interval``-th layer (1-based)
    full attention, the rest linear."""
    given = text.get("layer_types")
    if given is None:
        interval = int(text.get("full_attention_interval", DEFAULT_INTERVAL))
        if interval < 1:
            raise ValueError(f"full_attention_interval must be >= 1, got {interval}")
        given = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    kinds = tuple(str(k) for k in given)
    if len(kinds) != layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for num_hidden_layers={layers}")
    unknown = sorted(set(kinds) - {LINEAR, FULL})
    if unknown:
        raise NotImplementedError(f"layer_types {unknown} are not supported (only {LINEAR!r} and {FULL!r})")
    if FULL not in kinds:
        # The serving stack sizes its paged KV cache by the attention layers; a model without any has no KV at all.
        raise ValueError(f"layer_types has no {FULL!r} layer: glimpse needs at least one attention layer")
    return kinds


def _rope(text: dict[str, Any], head_dim: int) -> tuple[float, tuple[int, ...], int]:
    """(rope_theta, mrope_section, rotary_dim) from ``rope_parameters`` (transformers 5) or ``rope_scaling`` +
    top-level fields (older exports). Rotary covers the first ``head_dim * partial_rotary_factor`` dims of a head,
    and its frequencies are split over t/h/w interleaved, as transformers' Qwen3.5 always does."""
    rope: dict[str, Any] = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise NotImplementedError(f"rope type {rope_type!r} is not supported (only plain M-RoPE)")
    if rope.get("mrope_interleaved") is False:
        raise NotImplementedError("mrope_interleaved=false is not supported (Qwen3.5 interleaves t/h/w)")
    factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)))
    rotary_dim = int(head_dim * factor)  # transformers truncates the same way
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} gives {rotary_dim} rotary dims of head_dim {head_dim}: need "
                         "an even number in 2..head_dim")
    section = tuple(int(s) for s in rope.get("mrope_section", DEFAULT_SECTION))
    if len(section) != 3 or sum(section) != rotary_dim // 2:
        raise ValueError(f"mrope_section {section} must be 3 sizes summing to rotary_dim/2 = {rotary_dim // 2} "
                         f"(head_dim {head_dim} x partial_rotary_factor {factor})")
    theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    return theta, section, rotary_dim


def _moe_fields(text: dict[str, Any]) -> dict[str, Any]:
    num_experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    if not num_experts:
        return {}
    # transformers' Qwen3.5-MoE renormalises the top-k weights and makes every layer sparse whatever these say.
    if not text.get("norm_topk_prob", True):
        raise NotImplementedError("norm_topk_prob=false is not supported (the router always renormalises)")
    if text.get("mlp_only_layers"):
        raise NotImplementedError("mlp_only_layers is not supported (every Qwen3.5-MoE layer is sparse)")
    if int(text.get("decoder_sparse_step", 1)) != 1:
        raise NotImplementedError("decoder_sparse_step != 1 is not supported (every Qwen3.5-MoE layer is sparse)")
    fields = {
        "num_experts": num_experts,
        "num_experts_per_tok": int(text["num_experts_per_tok"]),
        "moe_intermediate_size": int(text["moe_intermediate_size"]),
        "shared_expert_intermediate_size": int(text.get("shared_expert_intermediate_size") or 0),
    }
    if not 0 < fields["num_experts_per_tok"] <= num_experts:
        raise ValueError(f"num_experts_per_tok={fields['num_experts_per_tok']} must be in 1..num_experts={num_experts}")
    if fields["shared_expert_intermediate_size"] <= 0:
        raise ValueError("shared_expert_intermediate_size must be > 0 (every Qwen3.5-MoE layer has a shared expert)")
    return fields


def recurrent_spec(text: TextSpec) -> RecurrentSpec:
    """The Gated DeltaNet layers' per-sequence state, at TP 1."""
    return RecurrentSpec(
        num_layers=len(text.linear_layers),
        num_key_heads=text.linear_num_key_heads,
        num_value_heads=text.linear_num_value_heads,
        key_head_dim=text.linear_key_head_dim,
        value_head_dim=text.linear_value_head_dim,
        conv_kernel=text.linear_conv_kernel_dim,
    )


def check_tp(text: TextSpec, tp_size: int) -> None:
    """Raise a ValueError naming every field that does not split evenly over ``tp_size`` ranks (heads of both
    layer kinds, MLP and expert widths). KV heads may also be fewer than the ranks (each then replicated)."""
    if tp_size == 1:
        return
    kv = text.num_key_value_heads
    fields = {
        "num_attention_heads": text.num_attention_heads,
        "linear_num_key_heads": text.linear_num_key_heads,
        "linear_num_value_heads": text.linear_num_value_heads,
    }
    if text.num_experts:
        fields["moe_intermediate_size"] = text.moe_intermediate_size
        fields["shared_expert_intermediate_size"] = text.shared_expert_intermediate_size
    else:
        fields["intermediate_size"] = text.intermediate_size
    bad = [f"{name}={value}" for name, value in fields.items() if value % tp_size]
    if (kv % tp_size) if kv >= tp_size else (tp_size % kv):
        bad.append(f"num_key_value_heads={kv} (neither a multiple nor a divisor of it)")
    if bad:
        raise ValueError(f"this Qwen3.5 checkpoint does not split over tensor-parallel size {tp_size}: {', '.join(bad)}")
