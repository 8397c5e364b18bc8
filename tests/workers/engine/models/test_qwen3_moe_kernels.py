"""Qwen3-VL-MoE's routed experts: the grouped-GEMM path (sort by expert, torch._grouped_mm, un-permute)
against the per-expert loop, on the CPU (float32) and on CUDA (bf16, and inside a CUDA-graph capture)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from workers.engine.models.qwen3_vl.moe import experts_grouped, experts_loop, grouped_mm_usable


def _random_experts(
    t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, device: str, used: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [t, h], routing weights and ids [t, k], gate_up [e, 2i, h], down [e, h, i]; experts >= ``used``
    get no tokens (empty groups)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(t, h, generator=gen)
    top, ids = torch.softmax(torch.randn(t, used or e, generator=gen), -1).topk(k, dim=-1)
    weights = top / top.sum(-1, keepdim=True)
    gate_up = torch.randn(e, 2 * i, h, generator=gen) * h**-0.5
    down = torch.randn(e, h, i, generator=gen) * i**-0.5

    def put(a: Tensor) -> Tensor:
        return a.to(device, dtype)

    return put(x), put(weights), ids.to(device), put(gate_up), put(down)


def test_grouped_experts_equal_the_loop_on_cpu() -> None:
    """The sort/offset/un-permute logic of the grouped path, through torch._grouped_mm's CPU kernel."""
    x, w, ids, gate_up, down = _random_experts(37, 8, 2, 64, 48, torch.float32, "cpu", used=6)
    try:
        grouped = experts_grouped(x, w, ids, gate_up, down)
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        pytest.skip(f"torch._grouped_mm has no float32 CPU kernel here: {exc}")
    torch.testing.assert_close(grouped, experts_loop(x, w, ids, gate_up, down), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_gemm_experts_match_the_loop_in_bf16() -> None:
    # Real-model-like widths, 24 of 32 experts used (empty groups), one token and many.
    for t in (1, 300):
        x, w, ids, gate_up, down = _random_experts(t, 32, 8, 512, 256, torch.bfloat16, "cuda", used=24)
        assert grouped_mm_usable(x, gate_up, down)
        loop = experts_loop(x, w, ids, gate_up, down)
        grouped = experts_grouped(x, w, ids, gate_up, down)
        exact = experts_loop(*(a.float() if a.is_floating_point() else a for a in (x, w, ids, gate_up, down)))
        torch.testing.assert_close(grouped, loop, atol=3e-2, rtol=3e-2)
        # The grouped path sums each token's k outputs in float32: no worse than the bf16 loop.
        assert (grouped.float() - exact).abs().max() <= 1.5 * (loop.float() - exact).abs().max() + 1e-3
        fused_act = experts_grouped(x, w, ids, gate_up, down, fuse_act=True)
        torch.testing.assert_close(fused_act, grouped, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_gemm_experts_capture_in_a_cuda_graph() -> None:
    """No host sync on the grouped path: a CUDA graph captures it and replays it on new routing."""
    x, w, ids, gate_up, down = _random_experts(16, 32, 8, 512, 256, torch.bfloat16, "cuda")
    experts_grouped(x, w, ids, gate_up, down)  # first launches outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_grouped(x, w, ids, gate_up, down)
    ids.copy_(ids.roll(1, dims=0))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, experts_loop(x, w, ids, gate_up, down), atol=3e-2, rtol=3e-2)
