"""The MLPs of Qwen3-VL: dense SwiGLU, and Qwen3-VL-MoE's sparse block (a replicated top-k router over
SwiGLU experts).

Routing follows transformers' ``Qwen3VLMoeTextTopKRouter``: router logits in the model dtype, softmax in
float32, top-k, the k weights renormalised to sum to 1, cast back to the model dtype.

Expert weights are stacked per layer in Linear layout (out, in): ``gate_up_proj`` [E, 2*I_local, H] (each
expert's gate rows, then its up rows) and ``down_proj`` [E, H, I_local]. That is transformers' in-memory
layout, so the CPU loop can apply ``F.linear`` exactly as transformers does, and its transpose is the
column-major B operand ``torch._grouped_mm`` accepts without a copy. Tensor parallelism splits every
expert's intermediate dim (gate/up by rows, down by columns); each rank combines its partial expert
outputs and one all-reduce per layer sums them.

Checkpoints store experts in three ways, all loaded here:
* Hub (Qwen/Qwen3-VL-30B-A3B-*): fused ``experts.gate_up_proj`` [E, H, 2I] and ``experts.down_proj``
  [E, I, H] (x @ W layout);
* transformers 5 ``save_pretrained``: the same names in its in-memory layout [E, 2I, H] / [E, H, I] (it
  transposes Hub tensors on load and, as of 5.24, does not transpose them back on save);
* per-expert Linear weights ``experts.{e}.{gate,up,down}_proj.weight``.
A fused tensor whose shape fits both layouts (H == 2I, or H == I for down) is read as transformers reads
it: in-memory layout first.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.kernels import fp8_gemm, fused, moe_kernel
from workers.engine.kernels.fp8_quant import dequantize
from workers.engine.layers.deferred import weight_empty
from workers.engine.layers.linear import SINGLE_RANK, TPGroup, copy_into, divide, set_weight_loader


def moe_fields(text: dict[str, Any]) -> dict[str, Any]:
    """TextSpec's MoE fields from a (merged) text config; a dense config gives ``num_experts=0``."""
    num_experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    if not num_experts:
        return {"num_experts": 0}
    # transformers' Qwen3-VL-MoE router renormalises the top-k weights whatever this flag says (every
    # published checkpoint sets it true), so an unnormalised router would have no reference to match.
    if not text.get("norm_topk_prob", True):
        raise NotImplementedError("norm_topk_prob=false is not supported (the router always renormalises)")
    step = int(text.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(text["num_experts_per_tok"]),
        "moe_intermediate_size": int(text["moe_intermediate_size"]),
        "decoder_sparse_step": step,
        "mlp_only_layers": tuple(int(i) for i in text.get("mlp_only_layers") or ()),
    }


_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_shard(name: str) -> tuple[str, object] | None:
    """Map a per-expert checkpoint name to (stacked parameter name, shard id); None for any other name.

    Shard ids: ``("gate", e)`` / ``("up", e)`` into ``gate_up_proj``, ``e`` into ``down_proj``. Fused
    3-D names already equal the parameter names and load with shard id None."""
    m = _PER_EXPERT.search(name)
    if m is None:
        return None
    base, e, proj = name[: m.start()] + ".experts.", int(m[1]), m[2]
    if proj == "down_proj":
        return base + "down_proj", e
    return base + "gate_up_proj", ("gate" if proj == "gate_proj" else "up", e)


def expert_shards_needed(param_name: str, num_experts: int) -> int:
    """Per-expert shards that make up ``param_name`` (1 for a parameter that is not a stacked expert one)."""
    if param_name.endswith(".experts.gate_up_proj"):
        return 2 * num_experts
    if param_name.endswith(".experts.down_proj"):
        return num_experts
    return 1


class StackedExperts(nn.Module):
    """This rank's slice of every expert's SwiGLU weights (see the module docstring for the layout)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.inter_local = divide(intermediate_size, tp.size)
        il = self.inter_local
        # (Meta tensors while the loader defers them: layers/deferred.py.)
        self.gate_up_proj = nn.Parameter(weight_empty(num_experts, 2 * il, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(weight_empty(num_experts, hidden_size, il), requires_grad=False)
        set_weight_loader(self.gate_up_proj, self.load_gate_up)
        set_weight_loader(self.down_proj, self.load_down)
        # FP8 experts (models/fp8_layers.py): the two stacks' scales, per row [E, rows, 1] or per 128 x 128 tile
        # (fp8_quant.is_block), or None.
        self.gate_up_scale: Tensor | None
        self.down_scale: Tensor | None
        self.register_buffer("gate_up_scale", None)
        self.register_buffer("down_scale", None)

    # models/fp8_layers.py may make these stacks FP8 (the grouped FP8 GEMMs and the Triton kernels take them).
    fp8_grouped = True

    def fp8_scales(self) -> tuple[Tensor, Tensor] | None:
        if self.gate_up_scale is None or self.down_scale is None:
            return None
        return self.gate_up_scale, self.down_scale

    def fp8_grouped_usable(self, x: Tensor, scales: tuple[Tensor, Tensor]) -> bool:
        """Whether the grouped FP8 GEMM runs both FP8 stacks for x's rows (block scales: each stack's K checked)."""
        return fp8_gemm.grouped_usable(x, self.gate_up_proj, scales[0]) and fp8_gemm.grouped_usable(
            x, self.down_proj, scales[1])

    def bf16_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The two stacks in ``dtype``: as they are, or dequantized from FP8 (the fallback when no FP8 kernel runs)."""
        scales = self.fp8_scales()
        if scales is None:
            return self.gate_up_proj, self.down_proj
        return (dequantize(self.gate_up_proj, scales[0]).to(dtype),
                dequantize(self.down_proj, scales[1]).to(dtype))

    def _linear_layout(self, loaded: Tensor, out_features: int, in_features: int) -> Tensor:
        """A fused [E, out, in] (Linear) or [E, in, out] (Hub) tensor as an [E, out, in] view."""
        e = self.num_experts
        if loaded.shape == (e, out_features, in_features):
            return loaded
        if loaded.shape == (e, in_features, out_features):
            return loaded.transpose(1, 2)
        raise ValueError(
            f"fused expert tensor {tuple(loaded.shape)} is neither [{e}, {out_features}, {in_features}] "
            f"nor [{e}, {in_features}, {out_features}]"
        )

    def load_gate_up(self, param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
        il, full, start = self.inter_local, self.intermediate_size, self.tp.rank * self.inter_local
        if shard_id is None:  # every expert's gate then up rows, [E, 2I, H] once in Linear layout
            w = self._linear_layout(whole_on_device(loaded, param, self.tp.size), 2 * full, self.hidden_size)
            copy_into(param[:, :il], w[:, start : start + il], "expert shard")
            copy_into(param[:, il:], w[:, full + start : full + start + il], "expert shard")
            return
        if not (isinstance(shard_id, tuple) and shard_id[0] in ("gate", "up")):
            raise ValueError(f"gate_up_proj shard id must be ('gate'|'up', expert), got {shard_id!r}")
        which, e = shard_id
        offset = 0 if which == "gate" else il
        copy_into(param[e, offset : offset + il], loaded.narrow(0, start, il), "expert shard")

    def load_down(self, param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
        il, start = self.inter_local, self.tp.rank * self.inter_local
        if shard_id is None:
            w = self._linear_layout(whole_on_device(loaded, param, self.tp.size), self.hidden_size, self.intermediate_size)
            copy_into(param, w[:, :, start : start + il], "expert shard")
            return
        if not isinstance(shard_id, int):
            raise ValueError(f"down_proj shard id must be an expert index, got {shard_id!r}")
        copy_into(param[shard_id], loaded.narrow(1, start, il), "expert shard")


def whole_on_device(loaded: Tensor, param: Tensor, tp_size: int) -> Tensor:
    """A fused expert tensor moved whole (one dense copy) to the parameter's GPU before it is transposed: the Hub's
    [E, in, out] layout makes the parameter's view of it a transpose, and a strided copy from the host runs on the
    host (a [64, 2048, 1536] bf16 stack on the 2-core CI box: 0.7 GB/s transposed, 6.6 GB/s straight). Only at
    TP 1: a rank of TP N would move N times the bytes its slice needs. (Not yet timed on a GPU host:
    ``python -m benchmarks.engine.load_bench CHECKPOINT``.)"""
    if tp_size == 1 and param.device.type == "cuda" and loaded.device != param.device:
        return loaded.to(param.device)
    return loaded


def experts_loop(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """Reference combine, transformers' computation: for each expert that got tokens, in id order, its
    SwiGLU on those tokens, scaled by their routing weight and index-added to the output.

    x [T, H], weights/ids [T, k] -> [T, H]. One host sync (which experts got tokens): the CPU path."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        g, u = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def experts_grouped(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    gate_up: Tensor,
    down: Tensor,
    fuse_act: bool = False,
    fp8_scales: tuple[Tensor, Tensor] | None = None,
    gelu: bool = False,
) -> Tensor:
    """The same combine as ``experts_loop`` as two grouped GEMMs, with no loop and no host sync (so it can be
    captured in a CUDA graph).

    Token-expert pairs are sorted by expert, so each expert's rows are one contiguous group of the gathered
    input; ``searchsorted`` over the sorted ids gives the groups' end offsets (empty groups included). The
    weighted outputs are put back in (token, slot) order and each token's k rows summed: deterministic,
    unlike atomic scatter-adds, and the sum of k rounds once. ``fp8_scales``: the stacks are FP8 with these per-row
    scales, and both GEMMs are ``fp8_gemm.grouped_mm``. ``gelu``: the gate is tanh-GELU (Gemma 4), not SiLU; the
    result then has the routing weights' dtype (Gemma's stay float32), the k rows summed before one rounding."""
    t, k = ids.shape
    flat = ids.flatten()
    # Sorted ids and order from one sort, the offsets straight in int32, the experts' ids made once: a prefill
    # step of a 20-layer MoE is host-bound (launches), and these were three more launches a layer.
    sorted_ids, order = flat.sort(stable=True)
    ends = torch.searchsorted(sorted_ids, _expert_ids(gate_up.shape[0], flat), right=True, out_int32=True)
    rows = x[order // k]  # [t*k, H], grouped by expert
    if fp8_scales is None:
        h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends)  # [t*k, 2I]
    else:
        h = fp8_gemm.grouped_mm(rows, gate_up, fp8_scales[0], ends)
    if fuse_act and not gelu:
        h = fused.fast_silu_mul(h)
    else:
        g, u = h.chunk(2, dim=-1)
        h = (F.gelu(g, approximate="tanh") if gelu else F.silu(g)) * u
    if fp8_scales is None:
        y = torch._grouped_mm(h, down.transpose(1, 2), offs=ends)  # [t*k, H]
    else:
        y = fp8_gemm.grouped_mm(h, down, fp8_scales[1], ends)
    y = y * weights.flatten()[order].unsqueeze(-1)
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return unsorted.view(t, k, -1).sum(dim=1)


_EXPERT_IDS: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}


def _expert_ids(experts: int, like: Tensor) -> Tensor:
    """0 .. experts-1 on ``like``'s device and dtype, kept from the first use outside a CUDA-graph capture (inside
    one, a new tensor's kernel is only recorded: a kept one would hold nothing until the graph's first replay)."""
    key = (experts, like.device, like.dtype)
    out = _EXPERT_IDS.get(key)
    if out is None:
        out = torch.arange(experts, device=like.device, dtype=like.dtype)
        if not (like.is_cuda and torch.cuda.is_current_stream_capturing()):
            _EXPERT_IDS[key] = out
    return out


@functools.cache
def _grouped_mm_device_ok(device: torch.device) -> bool:
    # torch._grouped_mm (torch >= 2.9) runs on SM80+; older GPUs take the loop.
    return torch.cuda.get_device_capability(device) >= (8, 0)


def grouped_mm_usable(x: Tensor, gate_up: Tensor, down: Tensor) -> bool:
    """Whether ``experts_grouped`` can run: CUDA, bf16 (the dtype its kernel takes everywhere; fp16 needs
    cuBLASLt grouped GEMM from CUDA 13.3), and 16-byte-aligned row strides (H and I_local multiples of 8)."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and gate_up.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and x.shape[-1] % 8 == 0
        and down.shape[-1] % 8 == 0
        and _grouped_mm_device_ok(x.device)
    )


class SparseMoeBlock(nn.Module):
    """Router (``gate``, replicated) + stacked experts; forward [T, H] -> [T, H], all-reduced over TP."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        tp: TPGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        self.tp = tp
        self.top_k = top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, tp)
        self.fused = False  # CUDA: silu(gate) * up of the grouped path in one compiled kernel
        self.use_grouped = True  # False forces the loop (tests compare the two)

    def capturable(self) -> bool:
        """Whether a CUDA graph can hold this block: the grouped path has no host sync, the loop has (start_graphs)."""
        one_row = self.gate.weight[:1]  # [1, H]: the block's device and dtype
        scales = self.experts.fp8_scales()
        if scales is not None:
            return self.use_grouped and self.experts.fp8_grouped_usable(one_row, scales)
        return self.use_grouped and grouped_mm_usable(one_row, self.experts.gate_up_proj, self.experts.down_proj)

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """The router's logits [T, E] -> (weights [T, k] in their dtype, expert ids int64 [T, k])."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), ids

    def routed(self, x: Tensor, logits: Tensor | None = None) -> Tensor:
        """This rank's partial sum of the routed experts' outputs for x [T, H] (not yet reduced over TP ranks);
        ``logits``: the router's, where the caller computed them."""
        gate_up: Tensor = self.experts.gate_up_proj
        down: Tensor = self.experts.down_proj
        if logits is None:
            logits = F.linear(x, self.gate.weight)
        if self.use_grouped and moe_kernel.wanted(x, gate_up):  # a decode step's few rows: three Triton kernels
            weights, ids = moe_kernel.route(logits, self.top_k)
            return moe_kernel.experts(x, weights, ids, gate_up, down, scales=self.experts.fp8_scales())
        weights, ids = self.route(logits)
        scales = self.experts.fp8_scales()
        if scales is not None:
            if self.use_grouped and self.experts.fp8_grouped_usable(x, scales):
                return experts_grouped(x, weights, ids, gate_up, down, self.fused and fused.worth_it(x), scales)
            gate_up, down = self.experts.bf16_weights(x.dtype)
        if self.use_grouped and grouped_mm_usable(x, gate_up, down):
            return experts_grouped(x, weights, ids, gate_up, down, self.fused and fused.worth_it(x))
        return experts_loop(x, weights, ids, gate_up, down)

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_reduce(self.routed(x))
