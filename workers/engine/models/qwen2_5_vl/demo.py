"""The Qwen2.5-VL demo checkpoint: Qwen2.5-VL's architecture at toy sizes (shared pieces in
workers/engine/models/demo_writer.py)."""

from __future__ import annotations

import json
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

# Qwen2-VL's prompt format, written from scratch: a default system turn, `<|im_start|>role\n...<|im_end|>\n`
# per message, and one vision_start/pad/vision_end triple per image or video part (the processor later
# repeats the pad token once per merged patch). With `tools`, as Qwen2.5's own template does: the system
# turn (the caller's, else the default text) is followed by a "# Tools" section listing one JSON schema per
# line inside <tools>; an assistant turn's tool calls follow its text as <tool_call> JSON blocks, each on a
# new line; consecutive `tool` messages share one user turn of <tool_response> blocks. Every literal
# newline is emitted by an expression so the `-` whitespace control can keep the template itself readable.
CHAT_TEMPLATE = qwen_chat_template(
    "<|vision_start|><|video_pad|><|vision_end|>",
    r"""
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {{- render(messages[0]['content']) if has_system else 'You are a helpful assistant.' -}}
  {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
""",
    r"""
{%- elif not has_system -%}
  {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
{%- endif -%}
""",
    r"""
  {%- elif role == 'assistant' and message['tool_calls'] -%}
    {{- '<|im_start|>assistant' -}}
    {%- if message['content'] -%}
      {{- '\n' + render(message['content']) -}}
    {%- endif -%}
    {%- for call in message['tool_calls'] -%}
      {%- set fn = call['function'] if 'function' in call else call -%}
      {%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}
      {{- '\n<tool_call>\n{"name": "' + fn['name'] + '", "arguments": ' + args + '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif not (loop.first and has_system and tools) -%}
    {{- '<|im_start|>' + role + '\n' + render(message['content']) + '<|im_end|>\n' -}}
  {%- endif -%}
""",
)


def _preprocessor_config(ip: Any) -> dict[str, Any]:
    """Image settings in the flat layout of Qwen/Qwen2.5-VL-*-Instruct's preprocessor_config.json."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "min_pixels": ip.size["shortest_edge"],
        "max_pixels": ip.size["longest_edge"],
        "patch_size": ip.patch_size,
        "temporal_patch_size": ip.temporal_patch_size,
        "merge_size": ip.merge_size,
        "image_mean": list(ip.image_mean),
        "image_std": list(ip.image_std),
        "rescale_factor": ip.rescale_factor,
        "resample": 3,  # bicubic
        **{k: True for k in ("do_convert_rgb", "do_normalize", "do_rescale", "do_resize")},
    }


def build_config(special_ids: dict[str, int], vocab_size: int, text: Mapping[str, Any] | None = None) -> Any:
    """The Qwen2.5-VL architecture at toy sizes (head_dim 16 in both towers); ``text`` replaces fields of its
    ``text_config`` (a tied one ties the root too)."""
    from transformers import Qwen2_5_VLConfig

    text_config = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "hidden_act": "silu",
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "attention_dropout": 0.0,
        "use_sliding_window": False, "max_window_layers": 3,
        # mrope_section splits head_dim/2 = 8 rotary frequencies into temporal/height/width groups.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        "initializer_range": LINEAR_STD,
        "bos_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": special_ids["<|im_end|>"],
        "pad_token_id": special_ids["<|endoftext|>"],
        **(text or {}),
    }
    vision_config = {
        "depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "hidden_act": "silu",
        "in_channels": 3, "out_hidden_size": 64, "tokens_per_second": 2,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        # 112 px windows = 4x4 merged tokens, so images of a few hundred pixels span several windows.
        "window_size": 112, "fullatt_block_indexes": [1, 3],
        "initializer_range": LINEAR_STD,
    }
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=special_ids["<|image_pad|>"],
        video_token_id=special_ids["<|video_pad|>"],
        vision_start_token_id=special_ids["<|vision_start|>"],
        vision_end_token_id=special_ids["<|vision_end|>"],
        tie_word_embeddings=bool(text_config.get("tie_word_embeddings")),
        dtype="float32",
    )


def write_demo(out: Path, variant: str = "qwen2_5_vl", text: Mapping[str, Any] | None = None) -> Path:
    """Write the Qwen2.5-VL demo checkpoint into the existing directory `out`. Same bytes on every run. ``text``:
    fields replacing the demo's in ``text_config`` (see ``build_config``)."""
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    raw_tok, special_ids, n_tokens = demo_tokenizer()
    tokenizer = save_tokenizer(raw_tok)
    # min 56x56 px; max 256 merged 28x28 tiles, so a large image costs at most 256 LM tokens.
    min_pixels, max_pixels = 56 * 56, 256 * 28 * 28
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, temporal_patch_size=2, merge_size=2
        ),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(
            min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, temporal_patch_size=2, merge_size=2
        ),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    # transformers 5 folds the image settings into processor_config.json; also write the classic
    # preprocessor_config.json that published Qwen2.5-VL checkpoints carry, so code reading either works.
    with open(out / "preprocessor_config.json", "w", encoding="utf-8") as f:
        json.dump(_preprocessor_config(processor.image_processor), f, indent=2, sort_keys=True)
        f.write("\n")

    model = init_model(Qwen2_5_VLForConditionalGeneration, build_config(special_ids, padded_vocab(n_tokens), text))
    save_model(model, special_ids, n_tokens, out)
    return out
