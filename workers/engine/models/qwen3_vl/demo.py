"""Tiny, random-weight Qwen3-VL (dense) and Qwen3-VL-MoE checkpoints, written on the spot like the Qwen2.5-VL
demo (workers/engine/models/demo_writer.py), whose tokenizer, seeds and weight init they share.

What differs from the Qwen2.5-VL demo is what differs between the real families: 16-px patches with 0.5/0.5
normalization, a learned 2D position table that is interpolated to every grid, DeepStack levels fed into
the first LM layers, interleaved M-RoPE, LayerNorm (not RMSNorm) in the vision tower, q/k norms in the LM,
no default system turn in the chat template, and (MoE) sparse experts stored fused, as on the Hub.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workers.engine.models.demo_templates import qwen_chat_template
from workers.engine.models.demo_writer import (
    LINEAR_STD,
    demo_tokenizer,
    init_model,
    padded_vocab,
    save_model,
    save_tokenizer,
)

PATCH, MERGE, TEMPORAL = 16, 2, 2
TILE = PATCH * MERGE  # one LM token covers a 32x32-px tile
# An image costs between 2x2 and 256 LM tokens. A clip's budget counts its frames too (temporal patches of 2
# frames), so this also caps a video at 256 LM tokens.
MIN_PIXELS, MAX_PIXELS = (2 * TILE) ** 2, 256 * TILE * TILE
MAX_VIDEO_PIXELS = TEMPORAL * MAX_PIXELS

# Qwen3-VL-Instruct's prompt format, written from scratch. Unlike Qwen2.5-VL there is no default system
# turn. With `tools`, the system turn (the caller's system text first, if any) lists one JSON schema per
# line inside <tools>; assistant tool calls become <tool_call> JSON blocks, and consecutive `tool` messages
# are folded into one user turn of <tool_response> blocks. A video part is a bare <|video_pad|>:
# transformers 5's Qwen3VLProcessor expands it into `<t seconds><|vision_start|>pads<|vision_end|>` per
# temporal patch, so a vision_start/end pair around it (as the Hub template writes, for processors that
# replace the whole triple) would end up doubled. Every newline comes from an expression so the `-`
# whitespace control can keep the template itself readable.
CHAT_TEMPLATE = qwen_chat_template(
    "<|video_pad|>",
    r"""
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if has_system -%}
    {{- render(messages[0]['content']) + '\n\n' -}}
  {%- endif -%}
  {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
""",
    r"""
{%- elif has_system -%}
  {{- '<|im_start|>system\n' + render(messages[0]['content']) + '<|im_end|>\n' -}}
{%- endif -%}
""",
    r"""
  {%- elif not (loop.first and has_system) -%}
    {{- '<|im_start|>' + role + '\n' + render(message['content']) -}}
    {%- if role == 'assistant' and message['tool_calls'] -%}
      {%- for call in message['tool_calls'] -%}
        {%- set fn = call['function'] if 'function' in call else call -%}
        {%- if message['content'] or not loop.first -%}
          {{- '\n' -}}
        {%- endif -%}
        {%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}
        {{- '<tool_call>\n{"name": "' + fn['name'] + '", "arguments": ' + args + '}\n</tool_call>' -}}
      {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
  {%- endif -%}
""",
)

# Gains applied on top of the shared per-name init (demo_writer.init_weights), picked by measuring greedy
# decoding over text, one- and two-image prompts. Qwen3's q/k RMSNorms pin q and k to unit RMS per head, so
# with weights ~1 the attention logits have std ~1 and attention stays nearly uniform: the first answer
# token then changed with the image for 1 of 8 noise images. QK_NORM_GAIN 3 gives logit std ~9, about where
# the Qwen2.5 demo's unnormalized q/k land; the first token then differs for 4-5 (dense) / 6-7 (MoE) of 8
# images, 28-32 of 32 greedy tokens are distinct, and the top-1/top-2 logit gap has median ~1.7 and 1st
# percentile ~0.025. POS_EMBED_GAIN lifts the learned position table from std 0.2 to 1.0 (the patch
# embedding has std ~3.5), so a wrong interpolation of it changes the output. MERGER_OUT_GAIN brings the
# image embeddings (main and DeepStack mergers) from std ~4.3 to ~1.1, the scale of the text embeddings.
# The router's logit std is already ~LINEAR_STD * sqrt(hidden) ~ 1.6: on a two-image prompt every layer
# uses all 8 experts and the busiest takes 42% / 33% / 23% of layer 0 / 1 / 2's top-2 picks, so the
# router keeps the shared init.
QK_NORM_GAIN = 3.0
POS_EMBED_GAIN = 5.0
MERGER_OUT_GAIN = 0.25


def _vision_config() -> dict[str, Any]:
    return {
        "depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "out_hidden_size": 64,
        "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL,
        # An 8x8 learned table: every image grid other than 8x8 patches goes through its bilinear resize.
        "num_position_embeddings": 64,
        # Two DeepStack levels, neither at the last block, so the levels and the main merger all differ.
        "deepstack_visual_indexes": [0, 2],
        "initializer_range": LINEAR_STD,
    }


def _text_config(ids: dict[str, int], vocab_size: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "hidden_act": "silu",
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "attention_bias": False,
        # mrope_section splits head_dim/2 = 8 rotary frequencies over t/h/w. Interleaved (as in the real
        # models) means frequency i goes to h if i % 3 == 1 and i < 3 * section[1], to w if i % 3 == 2 and
        # i < 3 * section[2], else to t: here t = {0, 3, 6}, h = {1, 4, 7}, w = {2, 5} (3 * 3 = 9 > 8).
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 5000000.0,
            "mrope_section": [2, 3, 3], "mrope_interleaved": True,
        },
        # The 2B/4B Hub models tie the LM head to the embeddings; untied here so a loader that ties (or
        # forgets lm_head) changes the output instead of passing unnoticed.
        "tie_word_embeddings": False,
        "initializer_range": LINEAR_STD,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }


def _moe_text_config(ids: dict[str, int], vocab_size: int) -> dict[str, Any]:
    return {
        **_text_config(ids, vocab_size),
        "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
        # Not 32: 2 * 32 == hidden 64 makes the fused gate_up tensor square, and
        # transformers then cannot tell the Hub's (E, hidden, 2I) layout from its own (E, 2I, hidden) by
        # shape, so it would save and load it untransposed while a Hub-layout reader transposes it.
        "moe_intermediate_size": 48,
        # transformers' router always renormalizes the top-k weights; the Hub configs say so with this key,
        # which other readers (vLLM, glimpse) look for.
        "norm_topk_prob": True,
    }


def _config(
    moe: bool, ids: dict[str, int], vocab_size: int, text: Mapping[str, Any], vision: Mapping[str, Any]
) -> Any:
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    cls = Qwen3VLMoeConfig if moe else Qwen3VLConfig
    text_config = {**(_moe_text_config if moe else _text_config)(ids, vocab_size), **text}
    return cls(
        text_config=text_config,
        vision_config={**_vision_config(), **vision},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        # transformers ties only on the root's flag; the Hub configs of the tied sizes carry it in both places.
        tie_word_embeddings=text_config["tie_word_embeddings"],
        dtype="float32",
    )


def _hub_preprocessor_configs() -> dict[str, dict[str, Any]]:
    """The classic files of Qwen/Qwen3-VL-*-Instruct, in their key order, with our pixel budgets."""
    common = {
        "patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
    }
    return {
        "preprocessor_config.json": {
            "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
            **common, "image_processor_type": "Qwen2VLImageProcessorFast",
        },
        "video_preprocessor_config.json": {
            "size": {"longest_edge": MAX_VIDEO_PIXELS, "shortest_edge": MIN_PIXELS},
            **common, "video_processor_type": "Qwen3VLVideoProcessor",
        },
    }


def _apply_gains(model: Any) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                param.mul_(QK_NORM_GAIN)
            elif name.endswith("visual.pos_embed.weight"):
                param.mul_(POS_EMBED_GAIN)
            elif "merger" in name and ".linear_fc2." in name:
                param.mul_(MERGER_OUT_GAIN)


def _store_experts_as_on_hub(file: Path) -> None:
    """Rewrite the fused expert tensors in the Hub's layout: gate_up_proj (E, hidden, 2*I) with the gate
    half first, down_proj (E, I, hidden). transformers 5 holds them transposed and saves them as it holds
    them; on load it transposes whichever layout does not match its parameter's shape, so both read the
    same, but serving code must be tested on the layout real checkpoints have."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    for name in tensors:
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


def write_processor(out: Path) -> tuple[dict[str, int], int]:
    """The demo tokenizer (trained on the spot), the Qwen3-VL processor with its chat template and the Hub's
    separate preprocessor files into ``out`` (created if missing): what every Qwen3-VL-style demo shares. Returns the
    special tokens' ids and the tokenizer's size."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    out.mkdir(parents=True, exist_ok=True)
    raw_tok, ids, n_tokens = demo_tokenizer()
    pixels: dict[str, Any] = {
        "patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    }
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, **pixels
        ),
        tokenizer=save_tokenizer(raw_tok, model_max_length=262144),
        video_processor=Qwen3VLVideoProcessor(
            size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_VIDEO_PIXELS}, **pixels
        ),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    # transformers 5 folds these into processor_config.json; the Hub repos carry them as separate files,
    # so code reading either layout finds the same settings.
    for name, content in _hub_preprocessor_configs().items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    return ids, n_tokens


def _write(out: Path, moe: bool, text: Mapping[str, Any] | None = None, vision: Mapping[str, Any] | None = None) -> Path:
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    ids, n_tokens = write_processor(out)
    model_cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    model = init_model(model_cls, _config(moe, ids, padded_vocab(n_tokens), text or {}, vision or {}))
    _apply_gains(model)
    # A trained model never opens a tool response, and a random one should not open tool calls by chance
    # (a parser would swallow the rest of the reply): those rows are zeroed along with the special tokens.
    save_model(model, ids, n_tokens, out)
    if moe:
        _store_experts_as_on_hub(out / "model.safetensors")
    return out


def write_qwen3_vl(
    path: str | os.PathLike[str], text: Mapping[str, Any] | None = None, vision: Mapping[str, Any] | None = None
) -> Path:
    """Write the dense Qwen3-VL demo checkpoint into `path` (created if missing). Same bytes on every run.
    ``text`` / ``vision``: fields replacing the demo's (other published sizes' shapes, for tests); a tied ``text``
    ties the root too, and the head is then not saved."""
    return _write(Path(path), moe=False, text=text, vision=vision)


def write_qwen3_vl_moe(
    path: str | os.PathLike[str], text: Mapping[str, Any] | None = None, vision: Mapping[str, Any] | None = None
) -> Path:
    """Write the Qwen3-VL-MoE demo checkpoint into `path` (created if missing). Same bytes on every run.
    ``text`` / ``vision`` as for ``write_qwen3_vl``."""
    return _write(Path(path), moe=True, text=text, vision=vision)
