"""Qwen3.5-MoE's sparse block with its shared expert: the joined projection the fused (CUDA) path takes, one matmul
for the shared expert's gate_up, the router and the shared gate, against the three separate ones. CPU, float32."""

from __future__ import annotations

import torch

from workers.engine.models.qwen3_5.moe import SharedExpertMoeBlock


def block(seed: int) -> SharedExpertMoeBlock:
    torch.manual_seed(seed)
    moe = SharedExpertMoeBlock(hidden_size=32, num_experts=8, top_k=2, intermediate_size=16,
                               shared_intermediate_size=24)  # fmt: skip
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return moe


def test_the_joined_projection_answers_as_the_separate_ones_and_keeps_the_weights() -> None:
    moe = block(0)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    want = moe(x)
    weights = {name: p.detach().clone() for name, p in moe.named_parameters()}
    moe.fused = True
    got = moe(x)
    # 57 rows padded with zeros to 64: an odd width sends cuBLAS to an unaligned kernel
    assert moe._joined is not None and moe._joined.shape == (64, 32) and 2 * 24 + 8 + 1 == 57
    assert not moe._joined[57:].any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The three parameters are now views of the joined matrix, with their values unchanged.
    joined = moe._joined.untyped_storage().data_ptr()
    for part in (moe.shared_expert.gate_up_proj.weight, moe.gate.weight, moe.shared_expert_gate.weight):
        assert part.untyped_storage().data_ptr() == joined
    for name, p in moe.named_parameters():
        assert torch.equal(p, weights[name]), name
    # One row (a decode step) and the unfused path again: the same answers.
    torch.testing.assert_close(moe(x[:1]), want[:1], rtol=1e-5, atol=1e-5)
    moe.fused = False
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)


def test_no_join_where_a_weight_has_another_dtype() -> None:
    moe = block(2)
    moe.shared_expert_gate.weight.data = moe.shared_expert_gate.weight.data.double()
    assert not moe.join()
    assert moe._joined is None
