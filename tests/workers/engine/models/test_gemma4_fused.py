"""Gemma 4's language-model elementwise runs as compiled kernels (lm_layers.py's ``lm_`` functions, fused.py): each
compiles whole (fullgraph, as the CUDA warm-up compiles it) and computes what its eager definition does; on CUDA an
engine with them gives the eager engine's greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.workers.engine.models.engine_harness import FIVE, GREEDY, chat, make_engine
from workers.engine.kernels import fused
from workers.engine.layers.rotary import apply_rope
from workers.engine.models.gemma4.lm_layers import (
    lm_add_norm,
    lm_add_norm_scale,
    lm_norm_rope,
    lm_norm_sum,
    lm_router_input,
)
from workers.engine.models.gemma4.vision_layers import vit_gelu_mul, vit_rms_norm


def _cases() -> list[tuple[Callable[..., Tensor], tuple[Any, ...]]]:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen) * 2

    t, hidden, heads, d = 7, 96, 3, 32
    angles = torch.rand(t, 1, d, generator=gen) * 40
    cos, sin = angles.cos(), angles.sin()
    w = rand(hidden)
    return [
        (vit_rms_norm, (rand(t, hidden), w, 1e-6)),
        (vit_rms_norm, (rand(t, heads, d), None, 1e-6)),  # v's norm: no weight
        (lm_norm_rope, (rand(t, heads, d), rand(d), 1e-6, cos, sin)),
        (lm_add_norm, (rand(t, hidden), rand(t, hidden), w, 1e-6)),
        (lm_norm_sum, (rand(t, hidden), rand(t, hidden), w, rand(hidden), 1e-6)),
        (lm_router_input, (rand(t, hidden), rand(hidden), hidden**-0.5, 1e-6)),
        (lm_add_norm_scale, (rand(t, hidden), rand(t, hidden), w, 1e-6, rand(1))),
        (vit_gelu_mul, (rand(t, hidden), rand(t, hidden))),
    ]


@pytest.mark.parametrize("case", range(8))
def test_each_lm_run_compiles_whole_and_computes_its_eager_definition(case: int) -> None:
    fn, args = _cases()[case]
    want = fn(*args)
    got = fused.compiled(fn)(*args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_norm_rope_run_is_the_norm_then_the_rotary() -> None:
    """The eager definition the attention layer now calls is op for op the two steps it replaced."""
    x, weight = torch.randn(4, 2, 16), torch.randn(16)
    angles = torch.rand(4, 1, 16) * 9
    want = apply_rope(vit_rms_norm(x, weight, 1e-6), angles.cos(), angles.sin())
    assert torch.equal(lm_norm_rope(x, weight, 1e-6, angles.cos(), angles.sin()), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fixture", ["gemma4_model_dir", "gemma4_moe_model_dir"])
def test_cuda_fused_lm_gives_the_eager_tokens(fixture: str, request: pytest.FixtureRequest) -> None:
    """CUDA float32, decode graphs off on both sides: the compiled runs round as eager float32 does up to summation
    order, so greedy tokens agree."""
    model_dir: Path = request.getfixturevalue(fixture)
    prompts = [chat("Compare.", FIVE[:2]), [{"role": "user", "content": "Say something long about rivers."}]]
    tokens = {}
    for on in (True, False):
        engine = make_engine(model_dir, device="cuda", chunk_size=64, fused_kernels=on)
        engine.runner.graphs = None
        assert fused.enable(engine.runner.lm, on) > 0
        tokens[on] = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert tokens[True] == tokens[False]
