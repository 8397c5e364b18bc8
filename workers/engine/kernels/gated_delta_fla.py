"""flash-linear-attention's path for gated_delta.py (CUDA): not wired in yet, so the torch path serves."""

from __future__ import annotations

from torch import Tensor

from workers.engine.kernels.attention import AttentionMetadata


def available() -> bool:
    return False


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor, meta: AttentionMetadata,
    use_qk_l2norm: bool,
) -> Tensor:
    raise NotImplementedError
