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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("family", "dtype"), [("gemma4", "float32"), ("gemma4_moe", "bfloat16")])
def test_gemma4_graph_decode_gives_the_eager_tokens_on_cuda(
    family: str, dtype: str, request: pytest.FixtureRequest
) -> None:
    """Gemma 4's caches of two shapes and its sliding layers' own block pool in the decode graphs: sequences longer
    than the window (released window blocks read as the pool's scratch) decode to the eager tokens. float32 runs the
    gather path; the MoE in bfloat16 (the dtype its grouped experts capture in) runs the Triton kernel on both the
    sliding heads and the wide global ones."""
    model_dir = request.getfixturevalue("gemma4_model_dir" if family == "gemma4" else "gemma4_moe_model_dir")
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", dtype=dtype, block_size=16))
    assert engine.runner.num_window_blocks > 0 and engine.runner.graphs is not None
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [[{"role": "user", "content": f"Count to {n}: " + "one " * n}] for n in (3, 30, 90)]
    with_graphs = [o.token_ids for o in engine.generate(prompts, greedy)]
    assert engine.runner.graphs.stats["replays"] > 0
    assert engine.core.windows is not None and engine.core.windows.released > 0
    engine.runner.graphs = None
    assert [o.token_ids for o in engine.generate(prompts, greedy)] == with_graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fixture", ["demo_model_dir", "qwen3_model_dir"])
def test_kv_written_by_the_rotary_gives_the_backends_tokens_on_cuda(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode rows' K/V put into the cache by the rotary kernel (rope_kernel.cache_slots; the backend skips its
    write) against the backend's own write: the same bits in the same slots, so bf16 greedy tokens are equal, in
    the decode graphs and eagerly. Qwen2.5-VL (qkv bias) and Qwen3-VL (q/k norms)."""
    from workers.engine.kernels import rope_kernel

    model_dir = request.getfixturevalue(fixture)
    real, used = rope_kernel.cache_slots, []

    def counted(*args: object) -> torch.Tensor | None:
        slots = real(*args)  # type: ignore[arg-type]
        used.append(slots is not None)
        return slots

    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[{"role": "user", "content": f"Count to {n}: " + "one " * n}] for n in (3, 20, 40)]

    def tokens(cache_slots: object) -> tuple[list[list[int]], list[list[int]]]:
        monkeypatch.setattr(rope_kernel, "cache_slots", cache_slots)
        engine = Engine(EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16"))
        assert engine.runner.graphs is not None
        graphed = [o.token_ids for o in engine.generate(prompts, greedy)]
        assert engine.runner.graphs.stats["replays"] > 0
        engine.runner.graphs = None
        return graphed, [o.token_ids for o in engine.generate(prompts, greedy)]

    by_rotary = tokens(counted)
    assert any(used) and not all(used)  # decode rows took it; prefill chunks of more rows did not
    assert tokens(lambda *args: None) == by_rotary
