"""Checkpoint directories for benchmarks: the demo model, re-shaped to real model sizes without weights.

``load_format="dummy"`` builds random weights from config.json alone, so a 7B-shaped directory needs only
the config, the demo tokenizer and an image processor with the real model's pixel limits.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from workers.engine.models.demo_writer import ensure_demo_model

# Qwen2.5-VL-7B-Instruct's published shapes.
QWEN25_VL_7B_TEXT = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
}
QWEN25_VL_7B_VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 3584,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
}
QWEN25_VL_MAX_PIXELS = 12845056  # the real processor's cap: a 1080p image stays 1092 x 1932

# Qwen3-VL-8B-Instruct and Qwen3-VL-30B-A3B-Instruct's published shapes (their ViTs differ only in the output
# width, which is the LM's hidden size).
QWEN3_VL_VISION = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "patch_size": 16,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
QWEN3_VL_8B_TEXT = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 262144,
}
QWEN3_VL_30B_A3B_TEXT = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 262144,
    "num_experts": 128,
    "num_local_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
}
QWEN3_VL_MAX_PIXELS = 16777216  # the real processor's longest_edge: a 1080p image becomes 1920 x 1088
# Qwen3.5-27B and Qwen3.6-35B-A3B (= Qwen3.5-35B-A3B's topology): hybrid LMs, a gated full-attention layer every 4th
# (head_dim 256, rotary over a quarter of it), Gated DeltaNet in the others; the ViT is Qwen3-VL's without DeepStack.
QWEN3_5_LINEAR = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
}
QWEN3_5_27B_TEXT = {
    **QWEN3_5_LINEAR,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_value_heads": 48,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
}
QWEN3_5_9B_TEXT = {  # Qwen/Qwen3.5-9B (transformers' Qwen3_5TextConfig defaults are this model)
    **QWEN3_5_LINEAR,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_value_heads": 32,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
}
QWEN3_5_35B_A3B_TEXT = {
    **QWEN3_5_LINEAR,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_value_heads": 32,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
# Gemma 4's published shapes (google/gemma-4-26B-A4B-it, -31B-it): 5 sliding-window layers to 1 global one, the global
# layers' 512-wide heads with K = V, routed experts beside the dense MLP on 26B-A4B.
GEMMA4_TEXT = {
    "head_dim": 256,
    "global_head_dim": 512,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "vocab_size": 262144,
    "vocab_size_per_layer_input": 262144,
    "max_position_embeddings": 262144,
}
GEMMA4_26B_A4B_TEXT = {
    **GEMMA4_TEXT,
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_global_key_value_heads": 2,
    "num_experts": 128,
    "top_k_experts": 8,
    "moe_intermediate_size": 704,
}
GEMMA4_31B_TEXT = {
    **GEMMA4_TEXT,
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 60,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "num_global_key_value_heads": 4,
}
GEMMA4_VISION = {  # both sizes' SigLIP-style tower
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 72,
    "use_clipped_linears": True,
    "standardize": True,
    # read by other servers (vLLM 0.24 sizes its encoder budget from it); transformers drops it from its config class
    "default_output_length": 280,
    "position_embedding_size": 10240,
    "pooling_kernel_size": 3,
}
# shape -> (demo family it starts from, text fields, LM mrope_section; Gemma 4 has none)
SHAPES: dict[str, tuple[str, dict[str, Any], list[int]]] = {
    "7b": ("qwen2_5_vl", QWEN25_VL_7B_TEXT, [16, 24, 24]),
    "qwen3-8b": ("qwen3_vl", QWEN3_VL_8B_TEXT, [24, 20, 20]),
    "qwen3-30b-a3b": ("qwen3_vl_moe", QWEN3_VL_30B_A3B_TEXT, [24, 20, 20]),
    "qwen3.5-9b": ("qwen3_5", QWEN3_5_9B_TEXT, [11, 11, 10]),
    "qwen3.5-27b": ("qwen3_5", QWEN3_5_27B_TEXT, [11, 11, 10]),
    "qwen3.5-35b-a3b": ("qwen3_5_moe", QWEN3_5_35B_A3B_TEXT, [11, 11, 10]),
    "gemma4-26b-a4b": ("gemma4_moe", GEMMA4_26B_A4B_TEXT, []),
    "gemma4-31b": ("gemma4", GEMMA4_31B_TEXT, []),
}
HYBRID = ("qwen3_5", "qwen3_5_moe")
GEMMA4 = ("gemma4", "gemma4_moe")


def _gemma4_fields(cfg: dict[str, Any], fields: dict[str, Any]) -> None:
    text = cfg["text_config"]
    text.update(fields, enable_moe_block="num_experts" in fields, dtype="bfloat16")
    n = text["num_hidden_layers"]
    text["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    cfg["vision_config"].update(GEMMA4_VISION, dtype="bfloat16")
    cfg["dtype"] = "bfloat16"


def _set_rope(section: dict[str, Any], mrope: list[int]) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(section.get(key), dict):
            section[key]["mrope_section"] = mrope


def shaped_checkpoint(
    dest: Path, shape: str, max_pixels: int | None = None, quantize: str | None = None, layers: int = 0
) -> Path:
    """Write a checkpoint directory: ``shape`` is "demo" (real tiny weights) or a key of SHAPES (config only:
    "7b" Qwen2.5-VL-7B, "qwen3-8b", "qwen3-30b-a3b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b", "gemma4-26b-a4b",
    "gemma4-31b").

    ``max_pixels`` overrides the image processor's cap (e.g. the demo model at real 1080p token counts; Gemma 4
    sizes images by its token budget instead). Hybrid shapes get a full-attention layer every 4th, Gemma 4 a global
    layer every 6th (a prefix of ``layer_types`` keeps the pattern for fewer layers); ``layers`` keeps only the
    first that many decoder layers (0: all). ``quantize`` ("fp8-block" or "fp8-dynamic", demo_quantize.py's
    formats) writes the ``quantization_config`` the published FP8 repos carry (Qwen's ``-FP8``: block 128 x 128,
    ``weight_scale_inv``): a shape's config-only directory then serves with ``--load-format dummy`` as that FP8
    checkpoint would (fp8_layers.convert_dummy quantizes the random weights in its layout); the demo's weights
    are quantized as ``glimpse demo-model --quantize`` does.
    """
    family = SHAPES[shape][0] if shape in SHAPES else "qwen2_5_vl"
    src = ensure_demo_model(family=family)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "model.safetensors" and shape != "demo":
            continue
        shutil.copy(f, dest / f.name)
    cfg = json.loads((dest / "config.json").read_text())
    if shape in SHAPES and family in GEMMA4:
        _gemma4_fields(cfg, SHAPES[shape][1])
    elif shape in SHAPES:
        _, fields, mrope = SHAPES[shape]
        text = cfg.get("text_config", cfg)
        text.update(fields)
        text["head_dim"] = fields.get("head_dim", 128)
        if family in HYBRID:
            n = text["num_hidden_layers"]
            text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
            if family == "qwen3_5_moe":
                text.pop("intermediate_size", None)  # the MoE LM has no dense MLP
        if family == "qwen2_5_vl":
            text["layer_types"] = ["full_attention"] * text["num_hidden_layers"]
            text["max_window_layers"] = text["num_hidden_layers"]
        _set_rope(text, mrope)
        _set_rope(cfg, mrope)
        for key in ("hidden_size", "vocab_size"):  # some layouts mirror these at the top level
            if key in cfg and "text_config" in cfg:
                cfg[key] = text[key]
        if family == "qwen2_5_vl":
            cfg["vision_config"].update(QWEN25_VL_7B_VISION)
        else:
            cfg["vision_config"].update(QWEN3_VL_VISION, out_hidden_size=text["hidden_size"])
            if isinstance(text.get("rope_parameters"), dict):
                text["rope_parameters"]["rope_theta"] = 10_000_000.0 if family in HYBRID else 5_000_000.0
            if family in HYBRID:
                cfg["vision_config"].pop("deepstack_visual_indexes", None)
        cfg["torch_dtype"] = "bfloat16"
        max_pixels = max_pixels or (QWEN25_VL_MAX_PIXELS if family == "qwen2_5_vl" else QWEN3_VL_MAX_PIXELS)
    elif shape != "demo":
        raise ValueError(f"unknown shape {shape!r}")
    keep_layers(cfg, layers)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    if quantize is not None:
        _quantize(dest, quantize, weights=shape == "demo")
    if max_pixels is not None:

        def cap(target: dict[str, Any], pixels: int = max_pixels) -> None:
            target["max_pixels"] = pixels
            if isinstance(target.get("size"), dict):
                target["size"]["longest_edge"] = pixels

        edit_processor_configs(dest, ("preprocessor_config.json", "processor_config.json"), "image_processor", cap)
    return dest


def keep_layers(cfg: dict[str, Any], layers: int) -> None:
    """Keep the first ``layers`` decoder layers of config.json's ``cfg`` (0: all), their layer types with them."""
    if layers:
        text = cfg.get("text_config", cfg)
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:layers]


def _quantize(dest: Path, fmt: str, weights: bool) -> None:
    """The checkpoint in ``dest`` as FP8 format ``fmt``: its weights quantized (the demo's), or only the config's
    ``quantization_config`` (a config-only shape; lm_head is the one module it names as left in bf16)."""
    from workers.engine.models.demo_quantize import QUANTIZE_FORMATS, quantization_config, quantize_checkpoint

    if fmt not in QUANTIZE_FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; choose from {', '.join(QUANTIZE_FORMATS)}")
    if weights:
        quantize_checkpoint(dest, fmt)
        return
    cfg = json.loads((dest / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(fmt, [])
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))


@contextmanager
def processor_checkpoint() -> Iterator[Path]:
    """The demo checkpoint with Qwen2.5-VL-7B's image processor (a 1080p image is 10,764 patches) in a temporary
    directory: what the request-path benchmarks prepare images for."""
    with tempfile.TemporaryDirectory() as tmp:
        yield shaped_checkpoint(Path(tmp) / "ckpt", "demo", max_pixels=QWEN25_VL_MAX_PIXELS)


def edit_processor_configs(
    model_dir: Path, names: tuple[str, ...], section: str, edit: Callable[[dict[str, Any]], None]
) -> None:
    """Apply ``edit`` to the ``section`` of each named processor config that exists (to the whole file where it
    has no such section, the flat layout), and write it back."""
    for name in names:
        path = model_dir / name
        if not path.exists():
            continue
        cfg = json.loads(path.read_text())
        edit(cfg.get(section, cfg))
        path.write_text(json.dumps(cfg, indent=2))


def main() -> None:
    """``python -m benchmarks.checkpoints DEST --shape qwen3-8b [--quantize fp8-block] [--layers N]``."""
    from benchmarks.args import parser

    ap = parser(main.__doc__)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--shape", default="qwen3-8b", help="demo or one of " + ", ".join(SHAPES))
    ap.add_argument("--quantize", default=None, choices=("fp8-block", "fp8-dynamic"))
    ap.add_argument("--layers", type=int, default=0, help="decoder layers kept (0: all)")
    args = ap.parse_args()
    path = shaped_checkpoint(args.dest, args.shape, quantize=args.quantize, layers=args.layers)
    print(f"{path} ({args.shape}, {args.quantize or 'bf16'}, {args.layers or 'all'} layers)")


if __name__ == "__main__":
    main()
