"""Qwen3.5's linear-attention layer (Gated DeltaNet) over a flattened batch, its per-sequence state kept in slot
pools (``allocate_state``) that the kernels read and write through ``meta.state``.

Numerically it follows transformers' ``Qwen3_5GatedDeltaNet``: the q|k|v projection through a causal depthwise
conv1d and SiLU, beta = sigmoid(b), the decay g = -exp(A_log) * softplus(a + dt_bias) in float32, the gated delta
rule with L2-normalised q and k (workers/engine/kernels/gated_delta.py), then an RMSNorm per value head gated by
SiLU(z) (a plain ``weight * x`` norm, not the zero-centred one of the decoder), and the output projection.

Tensor parallelism splits everything by heads. Each rank keeps key heads [r*Hk/tp, (r+1)*Hk/tp) and value heads
[r*Hv/tp, (r+1)*Hv/tp); value head j reads key head j // (Hv/Hk), so every rank holds the key heads its value heads
read. The four input projections are one column-parallel matmul whose output is six sections (q, k, v, z, b, a),
each split by heads; the checkpoint's fused ``in_proj_qkv`` fills the first three (as the conv1d's channels,
laid out the same way, are split), ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` one each. ``out_proj`` is
row-parallel, the gated norm's weight (one value head wide) replicated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.kernels import fused, hybrid_kernels
from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.kernels.gated_delta import causal_conv1d_sections, gated_delta_rule
from workers.engine.layers.linear import (
    SINGLE_RANK,
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    copy_into,
    divide,
    set_weight_loader,
)
from workers.engine.models.qwen3_5.spec import TextSpec

# Checkpoint projection -> shard id of the fused ``in_proj`` (the sections each fills: see IN_PROJ_SHARDS).
IN_PROJ_PARTS: tuple[tuple[str, str], ...] = (
    (".linear_attn.in_proj_qkv.", "qkv"),
    (".linear_attn.in_proj_z.", "z"),
    (".linear_attn.in_proj_b.", "b"),
    (".linear_attn.in_proj_a.", "a"),
)
IN_PROJ_SHARDS: dict[str, range] = {"qkv": range(0, 3), "z": range(3, 4), "b": range(4, 5), "a": range(5, 6)}


def copy_sections(param: Tensor, loaded: Tensor, sizes: Sequence[int], parts: range, tp: TPGroup) -> None:
    """Copy this rank's rows of the consecutive sections ``parts`` (of global row counts ``sizes``, each split evenly
    over the ranks) from ``loaded`` (those sections, whole, one after another) into ``param`` (every section's rank
    slice, one after another)."""
    expected = sum(sizes[i] for i in parts)
    if loaded.shape[0] != expected:
        raise ValueError(f"checkpoint tensor {tuple(loaded.shape)}: expected {expected} rows for sections {list(parts)}")
    local = [s // tp.size for s in sizes]
    src = 0
    for i in parts:
        dst = sum(local[:i])
        copy_into(param.narrow(0, dst, local[i]), loaded.narrow(0, src + tp.rank * local[i], local[i]))
        src += sizes[i]


class SectionedColumnLinear(ColumnParallelLinear):
    """A column-parallel linear whose output is several sections, each split evenly over the ranks (per head);
    ``shards`` maps a checkpoint tensor's shard id to the consecutive sections it holds."""

    def __init__(self, in_features: int, sizes: Sequence[int], shards: dict[str, range], tp: TPGroup) -> None:
        self.sizes = list(sizes)
        self.shards = shards
        self.local_sizes = [divide(s, tp.size) for s in self.sizes]
        super().__init__(in_features, sum(self.sizes), bias=False, tp=tp)

    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
        if not isinstance(shard_id, str) or shard_id not in self.shards:
            raise ValueError(f"shard id must be one of {sorted(self.shards)}, got {shard_id!r}")
        copy_sections(param, loaded, self.sizes, self.shards[shard_id], self.tp)


class GatedRMSNorm(nn.Module):
    """RMSNorm over one value head, then times SiLU(gate): transformers' ``Qwen3_5RMSNormGated`` (normalised in
    float32, cast back before the weight multiply, the gate in float32, one final cast)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.fused = False  # CUDA: one kernel (hybrid_kernels.py, or the compiled fused.gated_rms_norm); set by fused.enable

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        if self.fused and fused.worth_it(x):
            norm = hybrid_kernels.gated_rms_norm if hybrid_kernels.wanted(x) else fused.compiled(fused.gated_rms_norm)
            out: Tensor = norm(x, gate, self.weight, self.eps)
            return out
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)


class DepthwiseConvWeight(nn.Module):
    """The conv1d's weight as the checkpoint stores it, [channels_local, 1, kernel], its channels (q|k|v heads) split
    like ``in_proj``'s first three sections."""

    def __init__(self, sizes: Sequence[int], kernel: int, tp: TPGroup) -> None:
        super().__init__()
        self.sizes, self.tp = list(sizes), tp
        local = sum(divide(s, tp.size) for s in self.sizes)
        self.weight = nn.Parameter(torch.empty(local, 1, kernel), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
        copy_sections(param, loaded, self.sizes, range(len(self.sizes)), self.tp)


def _head_sharded(size: int, tp: TPGroup) -> nn.Parameter:
    """A per-value-head vector (A_log, dt_bias): this rank's heads."""
    local = divide(size, tp.size)
    param = nn.Parameter(torch.empty(local), requires_grad=False)

    def load(p: Tensor, loaded: Tensor, shard_id: object = None) -> None:
        if loaded.shape != (size,):
            raise ValueError(f"per-head tensor {tuple(loaded.shape)}: expected ({size},)")
        copy_into(p, loaded.narrow(0, tp.rank * local, local))

    set_weight_loader(param, load)
    return param


class GatedDeltaNet(nn.Module):
    """One linear-attention layer: [T, hidden] -> [T, hidden] over a step's sequences, each continuing from (and
    leaving its state in) its slot of this layer's pools."""

    def __init__(self, spec: TextSpec, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        hk, hv = spec.linear_num_key_heads, spec.linear_num_value_heads
        dk, dv = spec.linear_key_head_dim, spec.linear_value_head_dim
        self.hk, self.hv = divide(hk, tp.size), divide(hv, tp.size)
        self.dk, self.dv = dk, dv
        self.kernel = spec.linear_conv_kernel_dim
        key, value = hk * dk, hv * dv
        conv_sizes = [key, key, value]
        self.in_proj = SectionedColumnLinear(spec.hidden_size, [*conv_sizes, value, hv, hv], IN_PROJ_SHARDS, tp)
        self.conv1d = DepthwiseConvWeight(conv_sizes, self.kernel, tp)
        self.A_log = _head_sharded(hv, tp)
        self.dt_bias = _head_sharded(hv, tp)
        self.norm = GatedRMSNorm(dv, spec.rms_norm_eps)
        self.out_proj = RowParallelLinear(value, spec.hidden_size, bias=False, tp=tp)
        # CUDA: the decay and write-strength gates in one compiled kernel (fused.delta_gates), and an all-decode step's
        # conv in another (fused.conv_decode) where conv_decode.py's Triton kernel is off. Set by fused.enable.
        self.fused = False
        self.key_local, self.value_local = self.hk * dk, self.hv * dv
        self.conv_dim_local = 2 * self.key_local + self.value_local
        # This layer's state pools (allocate_state); plain attributes, not buffers: they are no part of the weights.
        self.conv_state: Tensor | None = None
        self.ssm_state: Tensor | None = None

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        """Zeroed pools for ``num_slots`` sequences, bound to this layer: conv [S, conv_dim_local, K-1] and recurrent
        [S, Hv_local, Dk, Dv]."""
        self.conv_state = torch.zeros(num_slots, self.conv_dim_local, self.kernel - 1, dtype=dtype, device=device)
        self.ssm_state = torch.zeros(num_slots, self.hv, self.dk, self.dv, dtype=dtype, device=device)
        return [self.conv_state, self.ssm_state]

    def forward(self, x: Tensor, meta: AttentionMetadata, backend: AttentionBackend | None = None) -> Tensor:
        """``backend``: the step's attention backend. Piecewise CUDA graphs pass one with a ``mix_linear`` method,
        which runs `mix` eagerly between two captured pieces (runner/piecewise_graphs.py): the conv and the delta
        rule read the step's state slots and sequence bounds, which no graph of fixed shapes can hold."""
        t = x.shape[0]
        # Piecewise graphs hand a static buffer for the projection: the conv then reads q|k|v there between pieces.
        into = getattr(backend, "linear_projection", None)
        proj = self.in_proj(x) if into is None else self.in_proj.forward_into(x, into(self.in_proj.out_local))
        mixed, z, b, a = proj.split([self.conv_dim_local, self.value_local, self.hv, self.hv], dim=-1)
        # The gates before the conv (they do not depend on it): the eager part between two pieces stays the two
        # calls that read the state.
        if self.fused and fused.worth_it(x):
            gates = hybrid_kernels.delta_gates if hybrid_kernels.wanted(x) else fused.compiled(fused.delta_gates)
            g, beta = gates(a, b, self.A_log, self.dt_bias)
        else:
            beta = b.sigmoid()
            # float32 before exp and softplus, as transformers does (in fp16 exp(A_log) could overflow to inf).
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        split = getattr(backend, "mix_linear", None)
        core = split(self, mixed, g, beta) if split is not None else self.mix(mixed, g, beta, meta)
        out = self.norm(core, z.reshape(t, self.hv, self.dv))
        result: Tensor = self.out_proj(out.reshape(t, -1))
        return result

    def mix(
        self, mixed: Tensor, g: Tensor, beta: Tensor, meta: AttentionMetadata, out: Tensor | None = None
    ) -> Tensor:
        """The token mixing over the state: q|k|v [T, conv_dim_local] through the causal conv and SiLU, then the
        gated delta rule with decay ``g`` (float32) and write strength ``beta``, both [T, Hv_local] -> [T, Hv_local,
        Dv] (into ``out`` where given), each sequence from and back into its slots."""
        if self.conv_state is None or self.ssm_state is None:
            raise RuntimeError("linear-attention state pools are not allocated (call the LM's allocate_state first)")
        if meta.state is None:
            raise ValueError("a hybrid model's forward needs meta.state (StateMetadata: each sequence's state slot)")
        t = mixed.shape[0]
        weight = self.conv1d.weight
        q, k, v = causal_conv1d_sections(
            mixed, weight.view(weight.shape[0], -1), None, self.conv_state, meta,
            (self.key_local, self.key_local, self.value_local), activation="silu",
            fuse=self.fused and fused.worth_it(mixed),
        )  # fmt: skip
        core: Tensor = gated_delta_rule(
            q.reshape(t, self.hk, self.dk),
            k.reshape(t, self.hk, self.dk),
            v.reshape(t, self.hv, self.dv),
            g,
            beta,
            self.ssm_state,
            meta,
            use_qk_l2norm=True,
            out=out,
        )
        return core
