"""Shared pieces of the Gated DeltaNet kernel tests (test_gated_delta.py: the torch path against transformers' own
Qwen3.5 functions; test_gated_delta_fla.py: the flash-linear-attention wrapper): small head shapes, random inputs
and pools, step metadata, and transformers' conv and delta rule for one sequence with its state passed by hand."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from workers.engine.kernels import gated_delta
from workers.engine.kernels.attention import AttentionMetadata, StateMetadata

# transformers swaps in flash-linear-attention's or causal-conv1d's kernels where those packages import (CUDA only);
# the torch functions they wrap are the reference on every machine.
causal_conv1d_fn = inspect.unwrap(hf.causal_conv1d_fn)
causal_conv1d_update = inspect.unwrap(hf.causal_conv1d_update)
torch_chunk_gated_delta_rule = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
torch_recurrent_gated_delta_rule = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)

K_HEADS, K_DIM, V_DIM, KERNEL = 2, 32, 16, 4
SLOTS = 12
EXACT = 1e-5  # same chunking as the reference: rounding only
LOOSE = 1e-4  # another chunking (or a recurrent step for a chunk row): reassociated sums
BF16 = 2e-2


def make_meta(
    query_lens: list[int], slots: list[int], has_initial: list[bool],
    snapshots: list[tuple[int, int, int]] | None = None, device: str = "cpu",
) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(query_lens),
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        block_tables=torch.zeros(len(query_lens), 1, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(query_lens),
        state=StateMetadata(
            slots=torch.tensor(slots, dtype=torch.int64, device=device), slots_cpu=list(slots),
            has_initial=torch.tensor(has_initial, device=device), has_initial_cpu=list(has_initial),
            snapshots=list(snapshots or []),
        ),
    )


def close(got: Tensor, want: Tensor, tol: float) -> None:
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


class Inputs:
    """Random inputs shaped as Qwen3.5's GatedDeltaNet makes them: conv over q|k|v channels, g = -exp(A) *
    softplus(.) (negative), beta = sigmoid(.)."""

    def __init__(self, tokens: int, v_heads: int = K_HEADS, seed: int = 0, dtype: torch.dtype = torch.float32):
        gen = torch.Generator().manual_seed(seed)
        self.v_heads = v_heads
        self.channels = 2 * K_HEADS * K_DIM + v_heads * V_DIM
        self.x = torch.randn(tokens, self.channels, generator=gen).to(dtype)
        self.weight = (torch.randn(self.channels, KERNEL, generator=gen) * 0.5).to(dtype)
        self.bias = (torch.randn(self.channels, generator=gen) * 0.1).to(dtype)
        self.q = torch.randn(tokens, K_HEADS, K_DIM, generator=gen).to(dtype)
        self.k = torch.randn(tokens, K_HEADS, K_DIM, generator=gen).to(dtype)
        self.v = torch.randn(tokens, v_heads, V_DIM, generator=gen).to(dtype)
        a_log = torch.rand(v_heads, generator=gen).log()
        self.g = -a_log.exp() * F.softplus(torch.randn(tokens, v_heads, generator=gen) - 2)  # float32, as served
        self.beta = torch.randn(tokens, v_heads, generator=gen).sigmoid().to(dtype)

    def rows(self, s: int, e: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self.q[s:e], self.k[s:e], self.v[s:e], self.g[s:e], self.beta[s:e]


def pools(v_heads: int, channels: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> tuple[Tensor, Tensor]:
    """Pools full of random states (what other sequences left): a kernel must read only its own slots."""
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(SLOTS, channels, KERNEL - 1, generator=gen).to(dtype)
    ssm = (torch.randn(SLOTS, v_heads, K_DIM, V_DIM, generator=gen) * 0.3).to(dtype)
    return conv, ssm


def ref_conv(x: Tensor, weight: Tensor, bias: Tensor, window: Tensor | None) -> tuple[Tensor, Tensor]:
    """transformers' conv for one sequence's new rows x [n, C] after ``window`` [C, K-1] (None: no cache); returns
    the output [n, C] and the window after x."""
    n = x.shape[0]
    if window is not None and n == 1:  # cached decode
        state = window.clone().unsqueeze(0)
        out = causal_conv1d_update(x.t().unsqueeze(0), state, weight, bias, "silu")
        return out[0].t(), state[0]
    old = torch.zeros(x.shape[1], KERNEL - 1, dtype=x.dtype) if window is None else window
    full = torch.cat([old, x.t()], dim=1)
    if window is None:  # prefill without cache: the conv pads with zeros itself
        out = causal_conv1d_fn(x.t().unsqueeze(0), weight, bias, activation="silu")[0]
    else:  # prefill after a cached window (the Cache's update_conv_state): conv over [window; x], window rows dropped
        out = causal_conv1d_fn(full.unsqueeze(0), weight, bias, activation="silu")[0, :, -n:]
    return out.t(), full[:, -(KERNEL - 1):]


def ref_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
    """transformers' rule for one sequence, as Qwen3_5GatedDeltaNet calls it: recurrent for one cached token, else
    chunked. Returns output [n, Hv, Dv] and final state [Hv, Dk, Dv]."""
    rule = torch_recurrent_gated_delta_rule if state is not None and q.shape[0] == 1 else torch_chunk_gated_delta_rule
    out, final = rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        initial_state=None if state is None else state.unsqueeze(0), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert final is not None
    return out[0], final[0]


def run(inp: Inputs, meta: AttentionMetadata, conv: Tensor, ssm: Tensor, s: int = 0) -> tuple[Tensor, Tensor]:
    e = s + sum(meta.query_lens_cpu)
    conv_out = gated_delta.causal_conv1d(inp.x[s:e], inp.weight, inp.bias, conv, meta)
    rule_out = gated_delta.gated_delta_rule(*inp.rows(s, e), ssm, meta)
    return conv_out, rule_out

