"""The pre-norm decoder layer every family's LM is made of, or borrows parts of: GQA attention over the paged KV cache
(rotary from the forward's tables, K/V written by the rotary kernel on decode rows), the SwiGLU MLP, and the layer
that defers each residual add into the next RMSNorm so the add and the norm share a kernel on CUDA."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.kernels import fused, rope_kernel
from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata
from workers.engine.kernels.skinny_gemm import Partials, settled
from workers.engine.layers.linear import (
    SINGLE_RANK,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    TPGroup,
)
from workers.engine.layers.rotary import apply_rope
from workers.engine.models.decoder_spec import DecoderSpec


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU MLP, gate and up fused into one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=False, tp=tp
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, tp=tp)
        self.fused = False  # CUDA: silu(gate) * up in one kernel (fused.fast_silu_mul)
        # Set by the layer whose next step is an RMSNorm.add: the down projection's split-K sum is left to it.
        self.into_norm = False

    def forward(self, x: Tensor) -> Tensor | Partials:
        # fused: a split-K gate_up's partials go to the SiLU kernel, which sums them (silu_kernel.py)
        return self.from_gate_up(self.gate_up_proj.unsummed(x) if self.fused else self.gate_up_proj(x))

    def from_gate_up(self, gate_up: Tensor | Partials) -> Tensor | Partials:
        """The MLP after its gate_up projection (a caller may have computed it inside a wider matmul); unsummed
        partials only where ``into_norm`` is set."""
        down = self.down_proj.into_norm if self.into_norm else self.down_proj
        if self.fused and fused.worth_it(gate_up):
            out: Tensor | Partials = down(fused.fast_silu_mul(gate_up))
            return out
        gate, up = settled(gate_up).chunk(2, dim=-1)
        result: Tensor | Partials = down(F.silu(gate) * up)
        return result


class DecoderAttention(nn.Module):
    """GQA self-attention over the paged KV cache: q, k and v in one column-parallel matmul (heads split over TP
    ranks), rotary from the per-forward tables, the output projection row-parallel."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        d = spec.head_dim
        self.head_dim = d
        heads, kv_heads = spec.num_attention_heads, spec.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, d, heads, kv_heads, bias=qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(heads * d, spec.hidden_size, bias=o_bias, tp=tp)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.scale = d**-0.5
        self.fused = False  # CUDA: rotary of q and k in one kernel (rope_kernel.py; compiled where it is off)

    def rotate(
        self, qkv: Tensor | Partials, cos: Tensor, sin: Tensor, cache: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The projection's output [T, q + 2 kv] -> q and k with rotary applied, and v, each [T, heads, D]; a
        split-K decode product's partials are summed by the rotary kernel (rope_kernel.py). ``cache`` (kv_cache and
        the slots ``rope_kernel.cache_slots`` gave): the kernel also writes k and v there."""
        d = self.head_dim
        if self.fused and fused.worth_it(qkv) and rope_kernel.wanted(qkv, d):
            return rope_kernel.lm_rope(qkv, cos, sin, self.q_size, self.kv_size, d, cache=cache)
        qkv = settled(qkv)
        t = qkv.shape[0]
        if self.fused and fused.worth_it(qkv):
            q, k, v = fused.compiled(fused.lm_rope)(qkv, cos, sin, self.q_size, self.kv_size, d)
            return q, k, v
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return apply_rope(q.view(t, -1, d), cos, sin), apply_rope(k.view(t, -1, d), cos, sin), v.view(t, -1, d)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> Tensor | Partials:
        """The attention's output for the layer's post-attention ``RMSNorm.add`` (a split-K o projection's partials
        are summed there)."""
        qkv = self.qkv_proj.unsummed(x) if self.fused else self.qkv_proj(x)
        # decode rows: the rotary kernel writes K/V into the cache, and the backend only attends
        slots = rope_kernel.cache_slots(qkv, self.head_dim, kv_cache, meta, backend) if self.fused else None
        q, k, v = self.rotate(qkv, cos, sin, None if slots is None else (kv_cache, slots))
        out = backend.forward(q, k, v, kv_cache, meta if slots is None else meta.written(), self.scale)
        return self.o_proj.into_norm(out.reshape(x.shape[0], -1))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention, then the MLP (dense or sparse), each behind an RMSNorm."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        sum_in_next_norm(mlp)

    def forward(
        self,
        h: Tensor,
        delta: Tensor | Partials | None,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[Tensor, Tensor | Partials]:
        """(residual stream, previous layer's MLP output or None) -> the same pair after this layer.

        The MLP output is added to the stream by the *next* norm (``RMSNorm.add``), so on CUDA each residual
        add shares a kernel with the norm after it; the ops and their order are transformers' either way. A
        decode step's split-K projections hand that norm their partials (skinny_gemm.Partials): ``settled`` gives
        a caller that needs the output itself its sum."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm.add(h, delta)
        h, x = self.post_attention_layernorm.add(h, self.self_attn(x, cos, sin, kv_cache, meta, backend))
        out: Tensor | Partials = self.mlp(x)
        return h, out


def sum_in_next_norm(mlp: nn.Module) -> None:
    """A dense MLP whose output goes straight to the next layer's ``RMSNorm.add`` leaves its down projection's split-K
    sum to that norm (a MoE block's output is summed over experts first, so it keeps its own)."""
    if isinstance(mlp, SwiGLUMLP):
        mlp.into_norm = True
