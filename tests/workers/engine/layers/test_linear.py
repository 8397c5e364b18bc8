"""Tensor-parallel linears and the vocab embedding: every rank's shard, loaded from the full checkpoint tensor by its
weight loader, is the right slice (concatenating to the full tensor, or replicated where it must be)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from workers.engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    get_weight_loader,
)


def _rank_layers(make: Any, tp_size: int, loads: Sequence[tuple[str, Tensor, object]]) -> list[Any]:
    """Build one layer per rank and feed every rank the same full tensors through the weight loaders."""
    layers = []
    for rank in range(tp_size):
        layer = make(TPGroup(rank=rank, size=tp_size))
        for attr, full, shard_id in loads:
            param = getattr(layer, attr)
            get_weight_loader(param)(param, full, shard_id)
        layers.append(layer)
    return layers


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_column_row_merged_and_vocab_shards_concatenate_to_the_full_tensor(tp_size: int) -> None:
    w, b = torch.randn(8, 6), torch.randn(8)
    cols = _rank_layers(
        lambda tp: ColumnParallelLinear(6, 8, bias=True, tp=tp),
        tp_size,
        [("weight", w, None), ("bias", b, None)],
    )
    assert torch.equal(torch.cat([c.weight for c in cols]), w) and torch.equal(
        torch.cat([c.bias for c in cols]), b
    )

    w_row = torch.randn(6, 8)
    rows = _rank_layers(
        lambda tp: RowParallelLinear(8, 6, bias=True, tp=tp),
        tp_size,
        [("weight", w_row, None), ("bias", b[:6], None)],
    )
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), w_row)
    assert all(torch.equal(r.bias, b[:6]) for r in rows)  # replicated, added once after the all-reduce
    x = torch.randn(3, 8)  # partial products summed over ranks == the full matmul (what all-reduce does)
    partial = sum(xs @ r.weight.T for xs, r in zip(x.chunk(tp_size, dim=-1), rows, strict=True))
    torch.testing.assert_close(partial, x @ w_row.T)

    gate, up = torch.randn(8, 6), torch.randn(8, 6)
    merged = _rank_layers(
        lambda tp: MergedColumnParallelLinear(6, [8, 8], bias=False, tp=tp),
        tp_size,
        [("weight", gate, 0), ("weight", up, 1)],
    )
    halves = [m.weight.chunk(2) for m in merged]
    assert torch.equal(torch.cat([g for g, _ in halves]), gate) and torch.equal(
        torch.cat([u for _, u in halves]), up
    )

    emb = torch.randn(10, 4)  # 10 rows do not split evenly over 4 ranks: the table is padded to 12
    vocab = _rank_layers(lambda tp: VocabParallelEmbedding(10, 4, tp=tp), tp_size, [("weight", emb, None)])
    table = torch.cat([v.weight for v in vocab])
    assert torch.equal(table[:10], emb) and not table[10:].any()


@pytest.mark.parametrize(("tp_size", "num_kv_heads"), [(1, 2), (2, 2), (2, 4), (4, 2), (4, 1)])
def test_qkv_shards_split_or_replicate_kv_heads(tp_size: int, num_kv_heads: int) -> None:
    hidden, head_dim, num_heads = 6, 2, 4
    q_w, q_b = torch.randn(num_heads * head_dim, hidden), torch.randn(num_heads * head_dim)
    k_w, v_w = torch.randn(2, num_kv_heads * head_dim, hidden).unbind()
    k_b, v_b = torch.randn(2, num_kv_heads * head_dim).unbind()
    loads = [
        ("weight", q_w, "q"),
        ("weight", k_w, "k"),
        ("weight", v_w, "v"),
        ("bias", q_b, "q"),
        ("bias", k_b, "k"),
        ("bias", v_b, "v"),
    ]
    ranks = _rank_layers(
        lambda tp: QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=True, tp=tp),
        tp_size,
        loads,
    )
    group = num_heads // num_kv_heads
    q_parts, kv_heads_seen = [], {}
    for layer in ranks:
        for param, full_k, full_v in ((layer.weight, k_w, v_w), (layer.bias, k_b, v_b)):
            q, k, v = param.split([layer.q_size, layer.kv_size, layer.kv_size])
            if param is layer.weight:
                q_parts.append(q)
            start = layer.kv_head_start()
            rows = slice(start * head_dim, (start + layer.num_kv_heads_local) * head_dim)
            assert torch.equal(k, full_k[rows]) and torch.equal(v, full_v[rows])
        # Local query head i must find its KV head at local index i // per_kv (what enable_gqa assumes).
        first_q = layer.tp.rank * layer.num_heads_local
        per_kv = layer.num_heads_local // layer.num_kv_heads_local
        for i in range(layer.num_heads_local):
            assert (first_q + i) // group == layer.kv_head_start() + i // per_kv
        kv_heads_seen.update(
            dict.fromkeys(range(layer.kv_head_start(), layer.kv_head_start() + layer.num_kv_heads_local))
        )
    assert torch.equal(torch.cat(q_parts), q_w)
    assert sorted(kv_heads_seen) == list(range(num_kv_heads))  # replicated or split, every KV head is held


@pytest.mark.parametrize("bias", [False, True])
def test_forward_into_writes_the_product_into_a_static_buffers_rows(bias: bool) -> None:
    """Piecewise graphs hand a linear-attention layer's input projection a buffer of more rows than the step has: the
    product lands in the rows given, equal to ``forward``'s bit for bit (the same GEMM), the rest untouched."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(24, 40, bias=bias)
    with torch.no_grad():
        layer.weight.normal_()
        if layer.bias is not None:
            layer.bias.normal_()
    x = torch.randn(7, 24)
    buf = torch.full((10, 40), float("nan"))
    got = layer.forward_into(x, buf[:7])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, layer(x))
    assert buf[7:].isnan().all()
