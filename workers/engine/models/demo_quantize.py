"""FP8 demo checkpoints: a family's demo checkpoint rewritten in one of the two FP8 layouts published models use
(``glimpse demo-model --quantize fp8-block|fp8-dynamic``), so both loaders are exercised with no download.

* ``fp8-block`` is laid out as Qwen's ``-FP8`` repos are: every language-model Linear ``weight`` float8_e4m3fn with
  ``weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]`` (128 x 128 tiles, each tile's max to 448), and
  ``quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [128, 128],
  modules_to_not_convert: [...]}`` naming every Linear left in the model dtype.
* ``fp8-dynamic`` as llm-compressor's FP8_DYNAMIC scheme saves it (compressed-tensors): ``weight`` e4m3 with
  ``weight_scale`` ``[out, 1]`` in the weight's dtype, and a ``quantization_config`` with ``quant_method:
  compressed-tensors``, ``format: float-quantized``, one config group (weights 8-bit float static symmetric
  ``strategy: channel``, input activations dynamic per ``token``) and ``ignore`` patterns as its examples write them.
Both leave the vision tower, ``lm_head``, the embeddings, MoE routers and gates, norms and convolutions in the model
dtype, as those publishers do. Stacked 3-D expert tensors (the layout transformers saves some MoE families in) are
quantized per expert, their scale named after the tensor (``gate_up_proj_scale_inv`` / ``gate_up_proj_scale``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from torch import Tensor

from workers.engine.kernels.fp8_quant import BLOCK, quantize_block, quantize_rows

QUANTIZE_FORMATS = ("fp8-block", "fp8-dynamic")

# Modules the publishers keep in the model dtype, as llm-compressor's examples spell them (compressed-tensors'
# ``ignore``: exact names or ``re:`` patterns matched against module names).
CT_IGNORE = (
    "lm_head",
    "re:.*visual.*",
    "re:.*vision_tower.*",
    "re:.*embed_vision.*",
    "re:.*mlp.gate$",
    "re:.*shared_expert_gate$",
    "re:.*router.*",
    "re:.*mtp.*",
)
_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def _is_lm_linear(name: str) -> bool:
    """A language-model Linear's weight (or stacked experts) in transformers' naming, before the ignore list."""
    if not name.startswith("model.language_model.") and not name.startswith("model.layers."):
        return False
    return name.endswith(".weight") and not any(p in name for p in ("norm", "embed", "conv1d")) or bool(
        _STACKED_EXPERTS.search(name)
    )


def _is_linear_weight(name: str, tensor: Any) -> bool:
    """A 2-D weight that is not an embedding table or a norm: a Linear's, in any tower."""
    return tensor.dim() == 2 and name.endswith(".weight") and not any(p in name for p in ("norm", "embed_tokens", "pos_embed"))


def ignored(module: str, patterns: tuple[str, ...] = CT_IGNORE) -> bool:
    """Whether compressed-tensors' ``ignore`` list keeps ``module`` out of quantization."""
    return any(re.match(p[3:], module) if p.startswith("re:") else module == p for p in patterns)


def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def quantization_config(fmt: str, not_converted: list[str]) -> dict[str, Any]:
    """config.json's ``quantization_config`` for ``fmt``, as the publishers write it."""
    if fmt == "fp8-block":
        return {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "modules_to_not_convert": list(dict.fromkeys(["lm_head", *not_converted])),
            "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK],
        }
    args: dict[str, Any] = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8, "observer_kwargs": {},
            "symmetric": True, "type": "float"}
    return {
        "config_groups": {
            "group_0": {
                "format": "float-quantized",
                "input_activations": {**args, "dynamic": True, "observer": None, "strategy": "token"},
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {**args, "dynamic": False, "observer": "minmax", "strategy": "channel"},
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": list(CT_IGNORE),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.12.2",
    }


def quantize_tensors(tensors: dict[str, Tensor], fmt: str) -> tuple[dict[str, Tensor], list[str]]:
    """One safetensors file's tensors in FP8 format ``fmt``: the language model's Linear weights (and stacked
    experts) quantized, each with its scale beside it, the rest as they are; and the Linear modules left unquantized
    (Qwen's ``modules_to_not_convert`` names them). The quantization runs on the tensors' device."""
    if fmt not in QUANTIZE_FORMATS:
        raise ValueError(f"unknown FP8 demo format {fmt!r}; choose from {', '.join(QUANTIZE_FORMATS)}")
    result: dict[str, Tensor] = {}
    not_converted: list[str] = []
    for name, tensor in sorted(tensors.items()):
        if not (_is_lm_linear(name) and tensor.dim() in (2, 3)) or ignored(_module(name)):
            result[name] = tensor
            if _is_linear_weight(name, tensor):  # Qwen's lists name every Linear left unquantized, the ViT's too
                not_converted.append(_module(name))
            continue
        if fmt == "fp8-block":
            result[name], result[name + "_scale_inv"] = quantize_block(tensor)
        else:
            q, scale = quantize_rows(tensor)
            result[name], result[name + "_scale"] = q, scale.to(tensor.dtype)
    return result, not_converted


def write_quantization_config(out: Path, fmt: str, not_converted: list[str]) -> None:
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config(fmt, sorted(not_converted))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def quantize_checkpoint(out: Path, fmt: str) -> Path:
    """Rewrite the demo checkpoint in ``out`` (one model.safetensors) in FP8 format ``fmt``, in place."""
    from safetensors.torch import load_file, save_file

    file = out / "model.safetensors"
    result, not_converted = quantize_tensors(load_file(file), fmt)
    save_file(result, file, metadata={"format": "pt"})
    write_quantization_config(out, fmt, not_converted)
    return out
