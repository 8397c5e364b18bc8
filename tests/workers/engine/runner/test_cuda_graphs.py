"""Decode CUDA graphs: bucketing, and the CPU never taking that path (the graph itself is checked on GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ipc.prompts import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.layers.linear import TPGroup
from workers.engine.offline import Engine
from workers.engine.runner.cuda_graphs import MIN_WIDTH, decode_bucket, graphs_wanted


def test_buckets_pad_up_and_refuse_what_does_not_fit() -> None:
    assert decode_bucket(1, 1, 16, 4096) == (1, MIN_WIDTH)
    assert decode_bucket(3, 9, 16, 4096) == (4, MIN_WIDTH)
    assert decode_bucket(32, 16, 16, 4096) == (32, 16)
    assert decode_bucket(32, 17, 16, 4096) == (32, 32)
    assert decode_bucket(33, 17, 16, 4096) == (48, 32)
    assert decode_bucket(1, 3000, 16, 2048) is None  # wider than any sequence may get
    assert decode_bucket(64, 2048, 16, 4096) is None  # padded K/V gather too large for the graph pool
    assert decode_bucket(10_000, 1, 16, 4096) is None


def test_graphs_only_on_cuda_with_any_tp_and_can_be_switched_off(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not graphs_wanted(torch.device("cpu"), TPGroup())
    # TP ranks capture their all-reduces too (every rank replays the same graphs in the same order).
    assert graphs_wanted(torch.device("cuda"), TPGroup(rank=0, size=2)) == torch.cuda.is_available()
    monkeypatch.setenv("GLIMPSE_CUDA_GRAPHS", "0")
    assert not graphs_wanted(torch.device("cuda"), TPGroup())
    monkeypatch.delenv("GLIMPSE_CUDA_GRAPHS")
    engine = Engine(EngineConfig(model=str(demo_model_dir), device="cpu"))
    assert engine.runner.graphs is None
    # The scratch block for graph padding exists but is never handed out.
    assert engine.runner.kv_caches[0].shape[1] == engine.runner.num_blocks + 1
    assert engine.core.allocator.num_blocks == engine.runner.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_decode_gives_the_eager_tokens_on_cuda(demo_model_dir: Path) -> None:
    """float32 on CUDA, so eager and graph decode differ by rounding only and greedy tokens must agree;
    3 sequences pad to the batch-4 bucket, so the scratch-block padding rows run too."""
    engine = Engine(EngineConfig(model=str(demo_model_dir), device="cuda", dtype="float32"))
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[{"role": "user", "content": f"Count to {n}: " + "one " * n}] for n in (3, 20, 40)]
    graphs = engine.runner.graphs
    assert graphs is not None
    with_graphs = [o.token_ids for o in engine.generate(prompts, greedy)]
    assert graphs.stats["replays"] > 0 and graphs.stats["captures"] > 0
    engine.runner.graphs = None
    assert [o.token_ids for o in engine.generate(prompts, greedy)] == with_graphs
