"""The CUDA side of an FP8 checkpoint: once the loader has filled the language model from the dequantized
checkpoint (quantization.py), the layers whose checkpoint weights were FP8 get FP8 parameters back, and their
forward goes through kernels/fp8_gemm.py.

* Tensor-parallel linears (q/k/v, o, gate/up, down, Qwen3.5's linear-attention projections, shared experts) get
  the checkpoint's own FP8 values and scales back, exactly: each value was dequantized with one rounding, so
  dividing by the stored scale lands inside the same e4m3 rounding interval. The scales are laid out for the rank's
  fused shard by replaying the layer's own weight loader on them, block scales expanded to rows first
  (``[rows, ceil(in/128)]``: the same row slicing as the weight). Where every 128-row group then has one block scale
  (sub-projections on 128-row boundaries, as in the published models) they are stored as 128 x 128 tiles, else per
  row and 128 columns. A row-parallel shard that splits a 128-column block, and a fused layer with a part the
  checkpoint kept in the model dtype, stay in the model dtype.
* Stacked routed experts (Qwen3-VL-MoE, Qwen3.5-MoE) of a channel checkpoint: one scale per expert row, for
  ``torch._scaled_grouped_mm``'s row-wise recipe. Of a block checkpoint: the checkpoint's own values and tiles
  (exact, as above; per-expert tensors placed by hand, since a TP shard of down splits its columns, which the
  loader's row replay cannot follow), for fp8_grouped_block.py's grouped GEMM; ``GLIMPSE_FP8_BLOCK_EXPERTS`` may
  re-quantize them per row or keep them dequantized (fp8_gemm.py). Decode rows take moe_kernel.py's Triton kernels
  on either layout (probed apart: ``probe_fp8``). Gemma 4's experts (a GELU gate) alike. A down shard that splits a
  128-column block stays in the model dtype.
* Replicated ``nn.Linear`` layers (routers, Gemma 4's per-layer-input projections) and the vision tower stay in the
  model dtype: they were dequantized at load, and stay so.
On a GPU that runs them the conversion happens during the load, one module as soon as it is filled
(fp8_streaming.py), so the language model never exists whole in the model dtype.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import Tensor, nn

from workers.engine.kernels import fp8_gemm, moe_batched, moe_kernel
from workers.engine.kernels.fp8_quant import BLOCK, FP8, quantize_block, quantize_rows, quantize_with
from workers.engine.layers.linear import ColumnParallelLinear, RowParallelLinear, get_weight_loader
from workers.engine.models.quantization import Fp8Record

log = logging.getLogger("glimpse.fp8")
# Comma-separated parts of language-model module names whose FP8 checkpoint weights stay dequantized in the model
# dtype, as a publisher's ignore list keeps them (e.g. "self_attn"): to measure which layers pay in FP8.
KEEP_ENV = "GLIMPSE_FP8_KEEP_DTYPE"


def _kept(module_name: str) -> bool:
    return any(part in module_name for part in os.environ.get(KEEP_ENV, "").split(",") if part)


def _routes(lm: nn.Module, record: Fp8Record) -> dict[str, list[tuple[object, str]]]:
    """LM parameter name -> [(shard id, canonical checkpoint name)] of the FP8 checkpoint weights loaded into it."""
    route = getattr(lm, "route", None)
    params: dict[str, list[tuple[object, str]]] = {}
    for name in record:
        if name.startswith("lm."):
            local = name[len("lm.") :]
            param, shard_id = route(local) if route is not None else (local, None)
            params.setdefault(param, []).append((shard_id, name))
    return params


def _shard_scales(
    owner: ColumnParallelLinear | RowParallelLinear, entries: list[tuple[object, str]], record: Fp8Record, block: int | None
) -> Tensor | None:
    """The rank's shard's scales as the checkpoint stored them, laid out like its weight: [rows, ceil(in/128)] (block,
    row-expanded) or [rows, 1] (channel), built by the layer's own weight loader from each checkpoint tensor's scales.
    None where the layer cannot be FP8 with them: a row-parallel shard that splits a 128-column block, or a fused
    layer some of whose parts the checkpoint kept in the model dtype (rows no FP8 tensor covered)."""
    w = owner.weight
    rows, cols = w.shape
    if isinstance(owner, RowParallelLinear):
        if block is None:  # per output row, and a row-parallel layer has all its output rows
            return record[entries[0][1]][0].float().reshape(rows, 1).to(w.device) if len(entries) == 1 else None
        if owner.tp.size > 1 and cols % block:
            return None
    scales = torch.full((rows, -(-cols // block) if block else 1), float("nan"), device=w.device)
    load = get_weight_loader(w)
    for shard_id, name in entries:
        scale, shape = record[name]
        expanded = scale.float().repeat_interleave(block, dim=0)[: shape[0]] if block else scale.float().reshape(-1, 1)
        load(scales, expanded.to(w.device), shard_id)
    return None if bool(torch.isnan(scales).any()) else scales


def _compact(scales: Tensor) -> Tensor:
    """Row-expanded block scales [..., rows, kb] as 128 x 128 tiles where every 128-row group holds one value, else
    as they are."""
    rows = scales.shape[-2]
    if rows % BLOCK:
        return scales
    tiles = scales[..., ::BLOCK, :]
    return tiles if torch.equal(tiles.repeat_interleave(BLOCK, dim=-2), scales) else scales


@torch.no_grad()
def _convert_linear(owner: ColumnParallelLinear | RowParallelLinear, scales: Tensor) -> None:
    w = owner.weight
    q = quantize_with(w, scales)
    owner.weight = nn.Parameter(q, requires_grad=False)
    owner.weight_scale = _compact(scales) if scales.shape[1] > 1 or w.shape[1] <= BLOCK else scales


@torch.no_grad()
def _convert_experts(experts: Any, scales: tuple[Tensor, Tensor] | None = None) -> int:
    """Both stacks of a StackedExperts in FP8, where the grouped FP8 GEMM can run them (it needs the two): with
    ``scales`` (block scales laid out for the stacks, ``_expert_block_scales``) the checkpoint's own values come
    back, else each row is quantized; returns 1 if converted."""
    gate_up: Tensor = experts.gate_up_proj
    down: Tensor = experts.down_proj
    one_row = gate_up[0, :1]
    if scales is None:
        if not fp8_gemm.grouped_usable(one_row, down):
            return 0
        (q_gu, s_gu), (q_d, s_d) = quantize_rows(gate_up), quantize_rows(down)
    else:
        s_gu, s_d = scales
        if not (fp8_gemm.grouped_usable(one_row, gate_up, s_gu) and fp8_gemm.grouped_usable(one_row, down, s_d)):
            return 0
        q_gu, q_d = _requantize(gate_up, s_gu), _requantize(down, s_d)
    experts.gate_up_proj = nn.Parameter(q_gu, requires_grad=False)
    experts.down_proj = nn.Parameter(q_d, requires_grad=False)
    experts.gate_up_scale, experts.down_scale = s_gu, s_d
    return 1


def _requantize(stack: Tensor, scales: Tensor) -> Tensor:
    """The FP8 values of a stack the loader dequantized, one expert at a time (a float32 copy of a whole stack is
    gigabytes at published sizes)."""
    q = torch.empty(stack.shape, dtype=FP8, device=stack.device)
    for e in range(stack.shape[0]):
        q[e] = quantize_with(stack[e], scales[e])
    return q


def _expert_block_scales(
    experts: Any, gate_up: list[tuple[object, str]], down: list[tuple[object, str]], record: Fp8Record
) -> tuple[Tensor, Tensor] | None:
    """The block scales of the rank's expert stacks from the checkpoint's tensors (per expert, or fused [E, out, in]
    or [E, in, out] as transformers saves them): gate_up [E, 2I_local, ceil(H/128)] and down [E, H,
    ceil(I_local/128)], row-expanded, then as 128 x 128 tiles where the rows keep them whole (``_compact``). None where
    the stacks cannot be FP8 with them: a tensor-parallel shard of down whose columns split a 128-column block."""
    e_count, hidden, il, full = experts.num_experts, experts.hidden_size, experts.inter_local, experts.intermediate_size
    start = experts.tp.rank * il
    if experts.tp.size > 1 and il % BLOCK:
        return None
    device = experts.gate_up_proj.device
    s_gu = torch.full((e_count, 2 * il, -(-hidden // BLOCK)), float("nan"), device=device)
    s_d = torch.full((e_count, hidden, -(-il // BLOCK)), float("nan"), device=device)
    cols = slice(start // BLOCK, start // BLOCK + s_d.shape[2])  # down's column blocks of this rank
    for shard_id, name in gate_up:
        scale, shape = record[name]
        if shard_id is None:  # every expert's gate then up rows
            rows = _expert_rows(scale, shape, 2 * full, hidden).to(device)
            s_gu[:, :il], s_gu[:, il:] = rows[:, start : start + il], rows[:, full + start : full + start + il]
        elif isinstance(shard_id, tuple) and shard_id[0] in ("gate", "up"):
            which, e = shard_id
            offset = 0 if which == "gate" else il
            s_gu[e, offset : offset + il] = _expert_rows(scale[None], (1, *shape), full, hidden)[0, start : start + il].to(device)
        else:
            return None
    for shard_id, name in down:
        scale, shape = record[name]
        if shard_id is None:
            s_d[:] = _expert_rows(scale, shape, hidden, full)[:, :, cols].to(device)
        elif isinstance(shard_id, int):
            s_d[shard_id] = _expert_rows(scale[None], (1, *shape), hidden, full)[0, :, cols].to(device)
        else:
            return None
    if bool(torch.isnan(s_gu).any()) or bool(torch.isnan(s_d).any()):
        return None
    # (gate_up compacts only when 2 I_local is whole tiles, so I_local is whole blocks of the decode kernels' rows.)
    return _compact(s_gu), _compact(s_d)


def _expert_rows(scale: Tensor, shape: tuple[int, ...], out_rows: int, in_cols: int) -> Tensor:
    """A fused expert tensor's 128 x 128 tiles [E, ceil(out/128), ceil(in/128)] row-expanded to [E, out, ceil(in/128)];
    a tensor stored [E, in, out] (the Hub's layout for some families) has its tiles transposed first."""
    s = scale.float()
    if tuple(shape[1:]) != (out_rows, in_cols) and tuple(shape[1:]) == (in_cols, out_rows):
        s = s.transpose(1, 2)
    return s.repeat_interleave(BLOCK, dim=1)[:, :out_rows]


@torch.no_grad()
def convert_to_fp8(lm: nn.Module, record: Fp8Record, block: int | None) -> int:
    """Give the modules the checkpoint's FP8 weights were loaded into FP8 weights (see the module docstring);
    returns how many were converted."""
    routes = _routes(lm, record)
    return sum(convert_param(lm, name, routes, record, block) for name in sorted(routes))


def convert_param(
    lm: nn.Module, name: str, routes: dict[str, list[tuple[object, str]]], record: Fp8Record, block: int | None
) -> int:
    """Convert the module that LM parameter ``name`` (its FP8 checkpoint tensors: ``routes[name]``) belongs to, once
    filled: a tensor-parallel linear's weight, or a StackedExperts' two stacks (named by ``gate_up_proj``; its
    ``down_proj`` must be filled too). Returns 1 if converted, 0 where it stays in the model dtype."""
    owner_name, _, attr = name.rpartition(".")
    owner = lm.get_submodule(owner_name)
    if _kept(owner_name):
        return 0
    if isinstance(owner, ColumnParallelLinear | RowParallelLinear) and attr == "weight":
        scales = _shard_scales(owner, routes[name], record, block)
        if scales is None:
            return 0
        _convert_linear(owner, scales)
        return 1
    if getattr(owner, "fp8_grouped", False) and attr == "gate_up_proj":  # qwen3_vl/moe.py's StackedExperts
        mode = fp8_gemm.block_experts() if block is not None else "rowwise"
        if mode == "block":
            tiles = _expert_block_scales(owner, routes[name], routes.get(f"{owner_name}.down_proj", []), record)
            return _convert_experts(owner, tiles) if tiles is not None else 0
        if mode == "rowwise":
            return _convert_experts(owner)
    return 0


def _kernel_kind(layer: nn.Module) -> str:
    kind = fp8_gemm.scale_kind(layer.weight, layer.weight_scale)  # type: ignore[arg-type]
    return "rowwise" if kind == "channel" else kind


def _model_dtype(lm: nn.Module) -> torch.dtype:
    return next(p.dtype for p in lm.parameters() if p.is_floating_point() and p.dtype != FP8)


def probe_kernels(lm: nn.Module, device: torch.device) -> None:
    """Probe the FP8 layers' kernels now, eagerly: a first call inside a CUDA graph capture could not, and would
    dequantize."""
    kinds = {_kernel_kind(m) for m in lm.modules() if getattr(m, "weight_scale", None) is not None}
    if kinds and fp8_gemm.wants_w8a16(fp8_gemm.variant(), 1):
        kinds.add("w8a16")
    for kind in sorted(kinds):
        fp8_gemm.probe(kind, device)
    if any(getattr(m, "gate_up_scale", None) is not None for m in lm.modules()):  # decode rows of FP8 experts take the Triton MoE kernels if they pass on FP8 stacks
        moe_kernel.probe_fp8(device, _model_dtype(lm))
        if moe_batched.fp8_on():  # decode batches' (moe_batched.py, opt-in) alike
            moe_kernel.probe_batched_fp8(device, _model_dtype(lm))


def convert_loaded(lm: nn.Module, record: Fp8Record, block: int | None, rank: int = 0) -> int:
    """After the load: FP8 layers for the checkpoint's FP8 weights where the device runs FP8 GEMMs (else none)."""
    device = next(lm.parameters()).device
    if not fp8_gemm.wants_fp8_layers(device):
        return 0
    n = convert_to_fp8(lm, record, block)
    probe_kernels(lm, device)
    if rank == 0:
        log.info("FP8: %d language-model layers hold FP8 weights (%s scales, GEMM variant %s)",
                 n, "128x128 block" if block else "per-channel", fp8_gemm.variant())
    return n


def _dummy_tiles(stack: Tensor, gate_up: bool = False) -> Tensor:
    """128 x 128 block scales of each expert's random weights, one expert at a time; per row and 128 columns where
    the decode kernels could not read a gate_up stack's tiles (moe_kernel._scale_layout)."""
    tiles = torch.stack([quantize_block(w)[1] for w in stack])
    if gate_up and (stack.shape[1] // 2) % moe_kernel.UP_BLOCK_N:
        return tiles.repeat_interleave(BLOCK, dim=1)[:, : stack.shape[1]]
    return tiles


@torch.no_grad()
def convert_dummy(lm: nn.Module, block: int | None, rank: int = 0) -> int:
    """``--load-format dummy`` with an FP8 ``quantization_config``: every tensor-parallel linear (and, as for a
    checkpoint, the grouped experts) made FP8 from its random weights in the configured layout, so FP8 serving can be
    measured at real shapes without a checkpoint."""
    device = next(lm.parameters()).device
    if not fp8_gemm.wants_fp8_layers(device):
        return 0
    n = 0
    for name, module in lm.named_modules():
        if _kept(name):
            continue
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            q, scale = quantize_block(module.weight) if block else quantize_rows(module.weight)
            module.weight = nn.Parameter(q, requires_grad=False)
            module.weight_scale = scale
            n += 1
        elif getattr(module, "fp8_grouped", False):
            mode = fp8_gemm.block_experts() if block is not None else "rowwise"
            if mode == "block":  # each expert's tiles quantized as a checkpoint's would be
                stacks: tuple[Tensor, Tensor] = (module.gate_up_proj, module.down_proj)
                n += _convert_experts(module, (_dummy_tiles(stacks[0], gate_up=True), _dummy_tiles(stacks[1])))
            elif mode == "rowwise":
                n += _convert_experts(module)
    probe_kernels(lm, device)
    if rank == 0:
        log.info("FP8 (dummy weights): %d language-model layers hold FP8 weights", n)
    return n
