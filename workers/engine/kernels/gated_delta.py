"""Gated DeltaNet's token mixing over a flattened batch with per-sequence state pools: the causal depthwise conv1d
and the gated delta rule (Qwen3.5 / Qwen3-Next linear attention).

A step's new tokens are B sequences one after another (``AttentionMetadata.query_start_loc``); sequence b keeps its
state in slot ``meta.state.slots[b]`` of each pool and starts from zeros where ``meta.state.has_initial[b]`` is
False. Both functions leave every sequence's state after its last new token in its slot, and write the snapshots
``meta.state.snapshots`` asks for (the state after the first n new tokens of a sequence, into another slot).

API (implemented by the kernels owner; the model family calls exactly these):

    causal_conv1d(x [T, C], weight [C, K], bias [C] | None, conv_state [S, C, K-1], meta, activation="silu") -> [T, C]
    gated_delta_rule(q [T, Hk, Dk], k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv], beta [T, Hv], ssm_state [S, Hv, Dk, Dv],
                     meta, use_qk_l2norm=True) -> [T, Hv, Dv]
"""

from __future__ import annotations

from torch import Tensor

from workers.engine.kernels.attention import AttentionMetadata


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    meta: AttentionMetadata,
    activation: str | None = "silu",
) -> Tensor:
    """Depthwise causal conv over each sequence's new tokens, its window of the K-1 inputs before them taken from
    ``conv_state`` (zeros without initial state); the window after them is written back (and to snapshot slots)."""
    raise NotImplementedError


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    ssm_state: Tensor,
    meta: AttentionMetadata,
    use_qk_l2norm: bool = True,
) -> Tensor:
    """The gated delta rule of transformers' ``torch_chunk_gated_delta_rule`` (prefill) and
    ``torch_recurrent_gated_delta_rule`` (decode) for every sequence, from and back into ``ssm_state``."""
    raise NotImplementedError
