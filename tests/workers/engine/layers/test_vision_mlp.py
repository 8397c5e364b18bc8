"""The vision MLP's GPU layout (fused, zero-padded gate/up; zero-padded down width) computes the same function."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.engine.layers.vision_mlp import VisionMLP


def test_pack_keeps_the_function_names_and_shapes() -> None:
    torch.manual_seed(0)
    mlp = VisionMLP(64, 90, F.silu).double()  # 90 is not a multiple of 8, like the real 3420
    for p in mlp.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    x = torch.randn(37, 64, dtype=torch.float64)
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    expected = mlp(x)
    mlp.pack()
    # gate and up each padded to 96 rows, so both halves of the GEMM output start 16-byte aligned
    assert mlp.packed is not None and mlp.packed[0].shape == (192, 64) and mlp.packed[2].shape == (64, 96)
    # float64: the layout change (extra exact zeros, one GEMM for gate and up) is invisible
    torch.testing.assert_close(mlp(x), expected, atol=1e-12, rtol=0)
    after = mlp.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.packed[0].untyped_storage().data_ptr()
