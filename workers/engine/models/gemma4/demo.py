"""Tiny, random-weight Gemma 4 checkpoints (dense, and MoE like 26B-A4B), written on the spot like the other demos
(workers/engine/models/demo_writer.py: the same corpus, seeds and per-name weight init) in the layout the Hub's
``google/gemma-4-*-it`` repos have:
- config.json as the Hub writes it: ``text_config`` with ``global_head_dim`` / ``num_global_key_value_heads`` (which
  transformers turns into its ``per_layer_config``), ``layer_types``, ``sliding_window``, ``attention_k_eq_v``,
  ``final_logit_softcapping``, ``use_bidirectional_attention: "vision"``, the MoE fields; ``vision_config``; no audio;
- a ``GemmaTokenizer`` trained on the spot with Gemma 4's control tokens (demo_tokenizer.py) and a chat template in
  Gemma 4's format (demo_template.py), saved with transformers' ``Gemma4Processor`` (processor_config.json, with the
  image processor's ``max_soft_tokens`` 280, patch 16, pooling 3; preprocessor_config.json beside it);
- ``model.language_model.*`` / ``model.vision_tower.*`` / ``model.embed_vision.*`` tensors saved by transformers'
  ``Gemma4ForConditionalGeneration``: the dense demo ties its LM head to the embeddings (no ``lm_head.weight``, as on
  the Hub), the MoE demo does not (so a loader that always ties shows).

Shapes: hidden 64 over 6 layers, 5 sliding (window 64: a test passes it with a short prompt) then 1 full, sliding heads
of 16 dims (2 KV heads), full heads of 32 (1 KV head, K = V); a 2-layer vision tower of width 32; MoE: 4 experts, top 2,
beside each layer's dense MLP.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workers.engine.models.demo_writer import init_model, padded_vocab
from workers.engine.models.gemma4.demo_template import CHAT_TEMPLATE
from workers.engine.models.gemma4.demo_tokenizer import train_gemma_tokenizer

PATCH, POOLING, DEFAULT_BUDGET = 16, 3, 280
SLIDING, FULL = "sliding_attention", "full_attention"
LAYERS = (SLIDING,) * 5 + (FULL,)
SLIDING_WINDOW = 64
SOFTCAP = 30.0  # the Hub's final_logit_softcapping
# The learned position table starts at the shared init's std 0.2 against ~3 for a patch's projection: lifted so a
# patch's position shows in its embedding (a wrong x / y lookup changes the output).
POS_TABLE_GAIN = 5.0
# Picked by measuring greedy decoding (6 noise images, 3 text prompts, 32 tokens each). Gemma scales its input
# embeddings by sqrt(hidden): with the shared init's rows (norm ~8) the input outweighed every layer's output, and a
# tied head then answered the prompt's last token over and over. With every row (embedding, untied head) of norm 0.7
# and the final norm's weights 8x, the first answer token differs for each of the 6 images, 15-29 (dense) / 27-32 (MoE)
# of 32 greedy tokens are distinct, and the top-1/top-2 logit gap has median ~0.8 / 0.74 and 1st percentile ~0.02 /
# 0.01 (softcap 30 included).
ROW_NORM = 0.7
FINAL_NORM_GAIN = 8.0
# Control-token rows of a tied embedding are scaled down (not zeroed: they are inputs too) so their logits stay near
# 0, below the top logit: greedy output holds no image token or turn opener.
TIED_SPECIAL_ROW_GAIN = 0.05


def _text_config(moe: bool, ids: dict[str, int], vocab_size: int) -> dict[str, Any]:
    text: dict[str, Any] = {
        "model_type": "gemma4_text", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": len(LAYERS), "layer_types": list(LAYERS), "sliding_window": SLIDING_WINDOW,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
        "final_logit_softcapping": SOFTCAP, "use_bidirectional_attention": "vision",
        "attention_bias": False, "attention_dropout": 0.0,
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": vocab_size,
        "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
        "enable_moe_block": moe, "num_experts": None, "top_k_experts": None, "moe_intermediate_size": None,
        "tie_word_embeddings": not moe, "initializer_range": 0.02, "use_cache": True, "dtype": "float32",
        "pad_token_id": ids["<pad>"], "bos_token_id": ids["<bos>"], "eos_token_id": ids["<eos>"],
    }  # fmt: skip
    if moe:
        # 2 x 48 != 64: a fused expert tensor's layout shows in its shape.
        text.update(num_experts=4, top_k_experts=2, moe_intermediate_size=48)
    return text


def _vision_config() -> dict[str, Any]:
    return {
        "model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 131_072,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
        "patch_size": PATCH, "pooling_kernel_size": POOLING, "position_embedding_size": 10_240,
        "use_clipped_linears": False, "standardize": False, "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "dtype": "float32",
    }  # fmt: skip


def hub_config(
    moe: bool,
    ids: dict[str, int],
    vocab_size: int,
    text: Mapping[str, Any] | None = None,
    vision: Mapping[str, Any] | None = None,
    root: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """config.json of the demo, in the Hub's form; ``text`` / ``vision`` / ``root`` replace the demo's fields in
    ``text_config`` / ``vision_config`` / the root (a tied ``text`` ties the root too)."""
    text_config = {**_text_config(moe, ids, vocab_size), **(text or {})}
    return {
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
        "text_config": text_config, "vision_config": {**_vision_config(), **(vision or {})}, "audio_config": None,
        "image_token_id": ids["<|image|>"], "boi_token_id": ids["<|image>"], "eoi_token_id": ids["<image|>"],
        "video_token_id": ids["<|video|>"], "audio_token_id": ids["<|audio|>"],
        "boa_token_id": ids["<|audio>"], "eoa_token_index": ids["<audio|>"],
        "tie_word_embeddings": text_config["tie_word_embeddings"], "initializer_range": 0.02, "dtype": "float32",
        **(root or {}),
    }  # fmt: skip


def write_processor(out: Path) -> tuple[dict[str, int], int]:
    """The tokenizer, chat template and processor settings into ``out``; the control tokens' ids and the tokenizer's
    size."""
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    tokenizer, ids = train_gemma_tokenizer()
    image_processor = Gemma4ImageProcessor(patch_size=PATCH, pooling_kernel_size=POOLING, max_soft_tokens=DEFAULT_BUDGET)
    processor = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),  # the processor class needs one; no audio is served
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Gemma4VideoProcessor(patch_size=PATCH, pooling_kernel_size=POOLING),
        chat_template=CHAT_TEMPLATE,
        image_seq_length=DEFAULT_BUDGET,
    )
    processor.save_pretrained(out)
    # transformers 5 folds the image processor into processor_config.json; the classic file too, for readers of either.
    classic = {**image_processor.to_dict(), "processor_class": "Gemma4Processor"}
    (out / "preprocessor_config.json").write_text(json.dumps(classic, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return ids, len(tokenizer)


def _byte_ids(out: Path) -> list[int]:
    """The tokenizer's byte-fallback tokens (``<0x00>`` .. ``<0xFF>``)."""
    vocab: dict[str, int] = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    return [i for tok, i in vocab.items() if re.fullmatch(r"<0x[0-9A-F]{2}>", tok)]


def _shape_weights(model: Any, ids: dict[str, int], n_tokens: int, tied: bool, byte_ids: list[int]) -> None:
    """Gains on top of the shared per-name init (see ROW_NORM), and the output rows of ids a trained model never emits
    silenced: the vocabulary's padding rows zeroed, the control tokens' other than the two stop tokens zeroed in an
    untied head or scaled down in a tied one (where the rows are the tokens' input embeddings too). Byte-fallback
    tokens go with them: random weights would emit runs of them that are not UTF-8, whose text a streaming
    detokenizer and one decode of the whole answer spell differently (transformers folds the run into U+FFFDs)."""
    import torch

    stops = {ids["<eos>"], ids["<turn|>"]}
    specials = torch.tensor([i for i in ids.values() if i not in stops] + byte_ids)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            # Scales the model multiplies by: around 1, as trained ones are (the shared init draws them around 0).
            if name.endswith(("layer_scalar", "router.scale", "router.per_expert_scale")):
                tensor.add_(1.0)
            elif name.endswith("patch_embedder.position_embedding_table"):
                tensor.mul_(POS_TABLE_GAIN)
            elif name == "model.language_model.norm.weight":
                tensor.mul_(FINAL_NORM_GAIN)
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        for rows in (embed,) if tied else (embed, head):
            rows[:n_tokens] *= ROW_NORM / rows[:n_tokens].norm(dim=-1, keepdim=True)
            rows[n_tokens:] = 0.0
        if tied:
            head[specials] *= TIED_SPECIAL_ROW_GAIN
        else:
            head[specials] = 0.0


def write_gemma4(
    out: Path,
    moe: bool,
    text: Mapping[str, Any] | None = None,
    vision: Mapping[str, Any] | None = None,
    root: Mapping[str, Any] | None = None,
) -> Path:
    """Write the Gemma 4 demo checkpoint (``moe``: with routed experts, untied head) into ``out`` (created if
    missing). Same bytes on every run. ``text`` / ``vision`` / ``root``: fields replacing the demo's (other published
    sizes' shapes, e.g. an E2B's per-layer inputs and audio tower, for tests; see ``hub_config``)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, GenerationConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids, n_tokens = write_processor(out)
    config = hub_config(moe, ids, padded_vocab(n_tokens), text, vision, root)
    model = init_model(Gemma4ForConditionalGeneration, Gemma4Config.from_dict(config))
    _shape_weights(model, ids, n_tokens, tied=config["tie_word_embeddings"], byte_ids=_byte_ids(out))
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<bos>"], eos_token_id=[ids["<eos>"], ids["<turn|>"]], pad_token_id=ids["<pad>"],
        do_sample=False,
    )
    model.save_pretrained(out)
    # transformers writes its own form (per_layer_config instead of the global head fields): the Hub's replaces it.
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out
