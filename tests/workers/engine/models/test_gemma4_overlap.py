"""Gemma 4 MoE decode steps run the dense MLP on a side stream beside the routed experts (moe.py
``beside_experts``): only where that is safe and pays, and on CUDA with the same tokens as one stream."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers.engine.models.engine_harness import FIVE, GREEDY, chat, make_engine
from workers.engine.kernels import moe_kernel
from workers.engine.layers.linear import TPGroup
from workers.engine.models.gemma4 import lm, moe


def test_only_a_single_rank_cuda_decode_step_overlaps() -> None:
    decode = torch.zeros(3, 8)
    assert not moe.beside_experts(decode, TPGroup())  # CPU: one stream (the float32 exactness tests' path)
    meta = torch.zeros(3, 8, device="meta")  # a device that is not CUDA either
    assert not moe.beside_experts(meta, TPGroup())
    if torch.cuda.is_available():
        assert moe.beside_experts(decode.cuda(), TPGroup())
        assert not moe.beside_experts(decode.cuda(), TPGroup(rank=0, size=2))  # two all-reduces, two streams
        chunk = torch.zeros(moe_kernel.MAX_ROWS + 1, 8, device="cuda")
        assert not moe.beside_experts(chunk, TPGroup())  # a prefill chunk fills the card alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dense_mlp_beside_the_experts_gives_the_one_stream_tokens(
    gemma4_moe_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA bf16 with the decode CUDA graphs on (the fork and join are captured; float32 experts outside the decode
    kernels' rows cannot be, so float32 would run eagerly): the same kernels on the same inputs, so the same greedy
    tokens; the side stream was used."""
    prompts = [chat("Compare.", FIVE[:2]), [{"role": "user", "content": "Say something long about rivers."}]]
    forks = []

    def counted(device: torch.device) -> torch.cuda.Stream:
        forks.append(device)
        return moe.side_stream(device)

    monkeypatch.setattr(lm, "side_stream", counted)
    tokens = {}
    for on in (True, False):
        monkeypatch.setattr(moe, "OVERLAP_DENSE_MLP", on)
        engine = make_engine(gemma4_moe_model_dir, device="cuda", dtype="bfloat16", chunk_size=64)
        assert engine.runner.graphs is not None
        tokens[on] = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        assert bool(forks) == on
        forks.clear()
    assert tokens[True] == tokens[False]
