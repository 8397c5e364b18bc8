"""Quantized checkpoints: which ``quantization_config`` glimpse loads, and the load-time pass that pairs every
FP8 weight with its scale.

Two FP8 formats are read, each as its publishers write it:
* ``quant_method: fp8`` (Qwen's ``-FP8`` repos, transformers' fine-grained FP8): ``weight`` float8_e4m3fn and
  ``weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]``, ``weight_block_size: [128, 128]``,
  ``activation_scheme: dynamic``; modules left in the model dtype are listed in ``modules_to_not_convert``;
* ``quant_method: compressed-tensors`` (llm-compressor's FP8_DYNAMIC, Red Hat's repos): ``format:
  float-quantized``, weights 8-bit float ``strategy: channel`` (``weight_scale`` ``[out, 1]``) or ``block``
  128 x 128, input activations dynamic per token (or per 128-group for block); ``ignore`` lists the modules kept
  in the model dtype (exact names or ``re:`` patterns).
Anything else (awq, gptq, bitsandbytes, static activation scales, other block sizes, fp8 KV-cache scales) stops
start-up with one line naming it (``UnsupportedQuantization``).

Which tensors are FP8 is read from the checkpoint itself: a weight stored as float8 with a scale tensor beside it
(``<weight>_scale_inv`` / ``<weight>_scale``; fused expert tensors follow the same rule). ``dequantized`` turns
each pair into one float32 tensor under the weight's own name, so every family's loader, TP sharding included,
reads an FP8 checkpoint exactly as it reads a bf16 one: on CPU that is the whole FP8 path (the reference), on
CUDA the FP8 layers are then re-made from it (fp8_layers.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels.fp8_quant import BLOCK, FP8, dequantize

SUPPORTED = (
    "fp8 (128x128 weight blocks, dynamic activations) and compressed-tensors float-quantized FP8 "
    "(channel or 128x128-block weights, dynamic per-token or per-group activations)"
)


class UnsupportedQuantization(ValueError):
    """A ``quantization_config`` glimpse cannot serve (the one-line message names the method and what it loads);
    ``models.load_spec`` raises it as an ``UnsupportedModel``, which ``glimpse serve`` prints as one start-up line."""


@dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's ``quantization_config`` says about its FP8 weights."""

    method: str  # "fp8" | "compressed-tensors"
    block: int | None  # 128: 128 x 128 weight blocks; None: one scale per output channel
    scale_suffix: str  # appended to a weight's name to name its scale: "_scale_inv" or "_scale"
    ignore: tuple[str, ...]  # modules the checkpoint keeps in the model dtype, as the config spells them

    @property
    def name(self) -> str:
        return "fp8-block" if self.block else "fp8-dynamic"


def _unsupported(method: str, why: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"quantization method {method!r} is not supported ({why}); glimpse loads {SUPPORTED}")


def _fp8_scheme(qc: dict[str, Any]) -> Fp8Scheme:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _unsupported("fp8", f"activation_scheme {qc.get('activation_scheme')!r}, only dynamic")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _unsupported("fp8", f"fmt {qc.get('fmt')!r}, only e4m3")
    block = qc.get("weight_block_size")
    if block is None or list(block) != [BLOCK, BLOCK]:
        raise _unsupported("fp8", f"weight_block_size {block}, only [{BLOCK}, {BLOCK}]")
    return Fp8Scheme("fp8", BLOCK, "_scale_inv", tuple(qc.get("modules_to_not_convert") or ()))


def _ct_group(name: str, group: dict[str, Any]) -> int | None:
    """One compressed-tensors config group -> its weight block size (None: channel); raises if unsupported."""
    method = "compressed-tensors"
    w, a = group.get("weights") or {}, group.get("input_activations")
    if w.get("type") != "float" or w.get("num_bits") != 8 or not w.get("symmetric", True) or w.get("dynamic"):
        raise _unsupported(method, f"{name}: weights {w.get('type')} {w.get('num_bits')}-bit, only static symmetric 8-bit float")
    strategy = w.get("strategy")
    if strategy == "channel":
        block, act = None, "token"
    elif strategy == "block" and list(w.get("block_structure") or ()) == [BLOCK, BLOCK]:
        block, act = BLOCK, "group"
    else:
        raise _unsupported(method, f"{name}: weight strategy {strategy!r} {w.get('block_structure') or ''}".rstrip()
                           + f", only channel or block [{BLOCK}, {BLOCK}]")
    if a is None or not a.get("dynamic") or a.get("type") != "float" or a.get("num_bits") != 8 or a.get("strategy") != act:
        got = "none" if a is None else f"{'dynamic' if a.get('dynamic') else 'static'} {a.get('strategy')}"
        raise _unsupported(method, f"{name}: input activations {got}, only dynamic 8-bit float per {act}")
    return block


def _compressed_tensors_scheme(qc: dict[str, Any]) -> Fp8Scheme:
    if qc.get("format") != "float-quantized":
        raise _unsupported("compressed-tensors", f"format {qc.get('format')!r}, only float-quantized")
    if qc.get("kv_cache_scheme"):
        raise _unsupported("compressed-tensors", "a kv_cache_scheme; FP8 KV caches are chosen with --kv-cache-dtype")
    groups = qc.get("config_groups") or {}
    blocks = {_ct_group(name, g) for name, g in groups.items()}
    if len(blocks) != 1:
        raise _unsupported("compressed-tensors", f"{len(groups)} config groups of different weight strategies")
    return Fp8Scheme("compressed-tensors", blocks.pop(), "_scale", tuple(qc.get("ignore") or ()))


def parse_quantization(config: dict[str, Any]) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme from config.json (top level, or the text config's), None for an unquantized
    checkpoint; raises ``UnsupportedQuantization`` for any other method or variant."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "?"))
    if method == "fp8":
        return _fp8_scheme(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    raise _unsupported(method, "not an FP8 format")


def checkpoint_scheme(model_dir: str | Path) -> Fp8Scheme | None:
    return parse_quantization(json.loads((Path(model_dir) / "config.json").read_text()))


# An FP8 weight's checkpoint name -> (its stored scales, the weight's shape): what fp8_layers.py re-makes layers from.
Fp8Record = dict[str, tuple[Tensor, torch.Size]]


def dequantized(
    weights: Iterable[tuple[str, Tensor]], scheme: Fp8Scheme, record: Fp8Record | None = None
) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors with every FP8 weight and its scale replaced by one float32 tensor under the
    weight's name (the scale is found by name; whichever of the pair comes first waits for the other, so shard
    boundaries do not matter). Other tensors pass through untouched. Each FP8 weight's scales and shape go into
    ``record`` (scales are 1/16384 of the weights' elements for block FP8: small enough to keep until the end)."""
    suffix = scheme.scale_suffix
    waiting_weights: dict[str, Tensor] = {}
    waiting_scales: dict[str, Tensor] = {}
    for name, tensor in weights:
        if name.endswith(".input_scale") or name.endswith((".k_scale", ".v_scale")):
            raise _unsupported(scheme.method, f"static scale {name}; only dynamic activations")
        base = name[: -len(suffix)] if name.endswith(suffix) else ""
        if base.endswith((".weight", "_proj")):  # a Linear's weight or a fused expert tensor (not Gemma's per_expert_scale)
            if base in waiting_weights:
                yield base, _dequantize(base, waiting_weights.pop(base), tensor, record)
            else:
                waiting_scales[base] = tensor
        elif tensor.dtype == FP8:
            if name in waiting_scales:
                yield name, _dequantize(name, tensor, waiting_scales.pop(name), record)
            else:
                waiting_weights[name] = tensor
        else:
            yield name, tensor
    if waiting_weights or waiting_scales:
        lone = sorted(waiting_weights)[:3] + sorted(n + suffix for n in waiting_scales)[:3]
        raise ValueError(f"FP8 checkpoint has weights without scales or scales without weights: {', '.join(lone)}")


def _dequantize(name: str, weight: Tensor, scale: Tensor, record: Fp8Record | None) -> Tensor:
    if record is not None:
        record[name] = (scale, weight.shape)
    return dequantize(weight, scale)
