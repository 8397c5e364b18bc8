"""Programmatic dependent launch (pdl.py): when it is on, and a decode-shaped chain of the kernels that take it,
replayed from a CUDA graph, giving the plainly launched chain's bits on every replay."""

from __future__ import annotations

import pytest
import torch

from workers.engine.kernels import paged_attention, pdl, silu_kernel, skinny_gemm, split_norm
from workers.engine.kernels.skinny_gemm import Tile


def test_off_for_the_cpu_and_under_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdl.launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.enabled(torch.device("cuda", 0))
    assert pdl.launch(torch.device("cuda", 0)) == {"PDL": False}


def _chain(x: torch.Tensor, res: torch.Tensor, w: dict[str, torch.Tensor], kv: torch.Tensor,
           table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """A decode layer's kernels in a row, each reading the one before's output: attention over the cache, the split
    o projection summed in the norm, gate_up, SiLU, the split down projection summed in the next norm."""
    q = x.view(x.shape[0], 8, 64)
    attn = paged_attention.paged_decode(q, kv, table, lens, 0.125, table.shape[1] * kv.shape[2])
    o = skinny_gemm.unsummed(attn.reshape(x.shape[0], -1), w["o"], use=Tile(32, 128, 4, 4, 4))
    assert isinstance(o, skinny_gemm.Partials)
    res, h = split_norm.add_rms_norm(res, o, w["norm"], 1e-6)
    up = skinny_gemm.linear(h, w["gate_up"], use=Tile(32, 128, 1, 2, 4))
    down = skinny_gemm.unsummed(silu_kernel.silu_mul(up), w["down"], use=Tile(32, 128, 4, 4, 4))
    assert isinstance(down, skinny_gemm.Partials)
    return split_norm.add_rms_norm(res, down, w["norm"], 1e-6)[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_graph_of_pdl_launches_gives_the_plain_launches_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cuda")
    if not pdl.enabled(dev):
        pytest.skip("no programmatic dependent launch on this card or Triton")
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=dev, dtype=torch.bfloat16)

    hidden, inter = 512, 1024
    w = {"o": rand(hidden, hidden, scale=0.05), "gate_up": rand(2 * inter, hidden, scale=0.05),
         "down": rand(hidden, inter, scale=0.05), "norm": 1 + rand(hidden, scale=0.1)}  # fmt: skip
    kv = rand(2, 16, 16, 8, 64)  # [2, blocks, block_size, Hkv, D]
    table = torch.arange(16, dtype=torch.int32, device=dev).view(2, 8)
    lens = torch.tensor([100, 37], dtype=torch.int32, device=dev)
    inputs = [(rand(2, hidden), rand(2, hidden)) for _ in range(20)]

    monkeypatch.setenv(pdl.ENV, "0")
    want = [_chain(x, res, w, kv, table, lens) for x, res in inputs]

    monkeypatch.setenv(pdl.ENV, "1")
    x_in, res_in = inputs[0][0].clone(), inputs[0][1].clone()
    _chain(x_in, res_in, w, kv, table, lens)  # compiles the PDL variants outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x_in, res_in, w, kv, table, lens)
    for (x, res), expected in zip(inputs, want, strict=True):
        x_in.copy_(x)
        res_in.copy_(res)
        graph.replay()
        assert torch.equal(out, expected)
