"""Piecewise CUDA graphs for small steps: the buckets, and the same greedy tokens as the eager forward. On the CPU the
pieces are emulated (the same static buffers, padding and split attention, no graphs); on CUDA they are captured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from ipc.prompts import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.models import load_spec
from workers.engine.models.qwen3_vl.moe import SparseMoeBlock
from workers.engine.offline import Engine
from workers.engine.runner.piecewise_graphs import (
    PiecewiseGraphs,
    covering_bucket,
    default_tokens,
    token_buckets,
)
from workers.engine.runner.piecewise_split import LinearCall

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _prompts() -> list[list[dict[str, Any]]]:
    """Short and longer text prompts and two with a small image, so that steps mix prefill chunks with decodes."""
    texts = [[{"role": "user", "content": f"Count to {n}: " + "one two " * n}] for n in (2, 9, 30)]
    images = [
        [{"role": "user", "content": [{"type": "image", "image": _image(w, h, seed)},
                                      {"type": "text", "text": "What is here?"}]}]
        for w, h, seed in ((57, 83, 1), (120, 64, 2))
    ]
    return texts[:2] + images[:1] + texts[2:] + images[1:]


def _emulated(engine: Engine, max_tokens: int, kv_in_pieces: bool = True) -> PiecewiseGraphs:
    r = engine.runner
    scratch = r.num_blocks * r.cfg.block_size if kv_in_pieces else None  # the block no sequence is given
    # A window pool's spare block (Gemma 4's sliding layers), as start_graphs passes it.
    window = r.num_window_blocks * r.cfg.block_size if r.num_window_blocks and r.spec.kv_windows else None
    width = r.model.embed(torch.zeros(1, dtype=torch.int64)).shape[-1]
    return PiecewiseGraphs(r.lm, r.lm.attention_backend(r.device), r.kv_caches, width, max_tokens, r.dtype,
                           scratch_slot=scratch, emulate=True, deepstack_levels=_levels(engine),
                           window_scratch_slot=window)


def _levels(engine: Engine) -> int:
    spec = engine.runner.spec
    return spec.embed_width // spec.hidden_size - 1


def test_steps_pad_up_to_a_bucket_and_larger_ones_do_not_fit() -> None:
    assert token_buckets(512)[-1] == 512 and token_buckets(300)[-1] == 256 and token_buckets(0) == ()
    assert token_buckets(2000)[-1] == 1920 and token_buckets(4096)[-1] == 4096  # 128 apart to 2k, then 256
    # A worker whose steps stop at 2,000 tokens captures up to 2,048, not beyond; past the last bucket, all of them.
    assert covering_bucket(2000) == 2048 and covering_bucket(2048) == 2048 and covering_bucket(9000) == 4096
    assert list(token_buckets(4096)) == sorted(set(token_buckets(4096)))


@pytest.mark.parametrize(("fixture", "most"), [
    ("demo_model_dir", 1024), ("qwen3_model_dir", 1024), ("gemma4_model_dir", 1024), ("qwen3_moe_model_dir", 4096),
    ("gemma4_moe_model_dir", 4096), ("qwen3_5_model_dir", 4096), ("qwen3_5_moe_model_dir", 4096),
])
def test_models_with_experts_or_state_graph_larger_steps_by_default(
    fixture: str, most: int, request: pytest.FixtureRequest
) -> None:
    """Their steps stay host-bound up to the step budget; a dense attention-only model's hide it past ~1k tokens."""
    assert default_tokens(load_spec(request.getfixturevalue(fixture))) == most


@pytest.mark.parametrize("fixture", ["demo_model_dir", "qwen3_model_dir", "qwen3_moe_model_dir"])
def test_emulated_pieces_give_the_eager_tokens(fixture: str, request: pytest.FixtureRequest) -> None:
    """Steps of up to 40 tokens (prefill chunks beside decodes, and pure decodes: the CPU has no decode graphs) against
    buckets of up to 32: the smaller steps pad up to a bucket, the larger ones miss and run eagerly. Qwen3-VL's image
    steps carry DeepStack features: they take the DeepStack pieces, its text steps the plain ones."""
    model_dir: Path = request.getfixturevalue(fixture)
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256,
                                 chunk_size=40, lone_prefill_tokens=0, enable_prefix_caching=False))
    assert engine.runner.piecewise is None  # CPU: no graphs unless a test emulates them
    eager = [o.token_ids for o in engine.generate(_prompts(), GREEDY)]
    # The pieces write K/V themselves, or the eager attention does; buckets up to 32 (the image steps, 38 and 40
    # tokens, miss) or 48 (every step fits).
    for kv_in_pieces, most in ((True, 32), (False, 32), (True, 48)):
        pieces = engine.runner.piecewise = _emulated(engine, most, kv_in_pieces)
        assert pieces.buckets_in_use[-1] == most
        assert [o.token_ids for o in engine.generate(_prompts(), GREEDY)] == eager
        assert pieces.stats["replays"] > pieces.stats["deepstack_replays"]
        assert (pieces.stats["misses"] > 0) == (most == 32)
        assert (pieces.stats["deepstack_replays"] > 0) == (most == 48 and fixture != "demo_model_dir")  # Qwen3-VL
        assert len(pieces.layers) == engine.runner.spec.num_layers
        assert sorted(pieces.buckets) == sorted(set(pieces.buckets) & set(token_buckets(most)))


@pytest.mark.parametrize("fixture", ["gemma4_model_dir", "gemma4_moe_model_dir"])
def test_gemma4_layers_of_every_kind_give_the_eager_tokens_in_pieces(fixture: str, request: pytest.FixtureRequest) -> None:
    """Gemma 4: sliding layers (window 64 in the demo) that read the window pool, global layers of another head
    shape with K = V, image rows that see their whole image (each image's span in one step), the MoE's experts;
    prompts past the window. Buckets up to 320 take the image steps too, up to 128 only the text steps."""
    model_dir: Path = request.getfixturevalue(fixture)
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256,
                                 chunk_size=96, lone_prefill_tokens=0, enable_prefix_caching=False))
    prompts = [*_prompts()[:2], [{"role": "user", "content": "Tell me more: " + "rivers and hills " * 40}]]
    prompts += [[{"role": "user", "content": [{"type": "image", "image": _image(w, h, seed)},
                                              {"type": "text", "text": "Describe it " + "again " * 30}]}]
                for w, h, seed in ((57, 83, 1), (120, 64, 2))]
    eager = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    for kv_in_pieces, most in ((True, 320), (False, 320), (True, 128)):
        pieces = engine.runner.piecewise = _emulated(engine, most, kv_in_pieces)
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == eager
        assert pieces.stats["replays"] > 0 and (pieces.stats["misses"] > 0) == (most == 128)
        calls = pieces.layers
        assert len(calls) == engine.runner.spec.num_layers
        sliding = [c for c in calls if c.window]
        assert sliding and all(c.bidirectional and c.window_meta for c in sliding)  # image rows see their image there
        full = [c for c in calls if not c.window]
        assert full and all(not c.window_meta and c.heads != sliding[0].heads for c in full)
        assert len(pieces._buffers) == 2  # one set of static buffers per head shape


@pytest.mark.parametrize("fixture", ["qwen3_5_model_dir", "qwen3_5_moe_model_dir"])
def test_hybrid_layers_mix_their_state_between_the_pieces(fixture: str, request: pytest.FixtureRequest) -> None:
    """Qwen3.5: each Gated DeltaNet layer's conv and delta rule run between two pieces over the real rows, from and
    into the step's state slots. Chunks of 24 cut the images and the long prompt, so states carry across chunks
    beside decodes; with prefix caching on, the second pass resumes every prompt from a state snapshot taken in the
    first, inside pieces too. Buckets up to 32 take every step, up to 16 leave the full chunks to the eager forward,
    whose state the next pieces read on."""
    model_dir: Path = request.getfixturevalue(fixture)
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256, chunk_size=24,
                          lone_prefill_tokens=0, state_snapshot_every=1)
    prompts = _prompts()
    eager = Engine(config)
    expected = [[o.token_ids for o in eager.generate(prompts, GREEDY)] for _ in range(2)]
    assert eager.stats()["state_restores"] == len(prompts)  # the second pass resumed from snapshots
    for most in (32, 16):
        engine = Engine(config)
        pieces = engine.runner.piecewise = _emulated(engine, most)
        assert [[o.token_ids for o in engine.generate(prompts, GREEDY)] for _ in range(2)] == expected
        stats = engine.stats()
        assert stats["state_restores"] == len(prompts)
        assert stats["state_restored_tokens"] == eager.stats()["state_restored_tokens"]
        assert pieces.stats["replays"] > 0 and (pieces.stats["misses"] > 0) == (most == 16)
        linear = [c for c in pieces.layers if isinstance(c, LinearCall)]
        assert len(pieces.layers) == engine.runner.spec.num_layers
        assert len(linear) == len(engine.runner.lm.linear_layers()) > 0
        assert len({c.shape for c in linear}) == len(pieces._linear) == 1  # one set of buffers for them all
        # q|k|v read where the input projection's GEMM wrote them: no buffer of their own, no copy
        assert {c.projection for c in linear} == set(pieces._inputs) == {linear[0].shape[0] + 2 * linear[0].shape[1]
                                                                          + linear[0].shape[1] * linear[0].shape[2]}


def test_a_step_that_fits_no_bucket_is_left_to_the_eager_forward(demo_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(demo_model_dir), device="cpu", dtype="float32", num_kv_blocks=64))
    pieces = engine.runner.piecewise = _emulated(engine, 16)
    prompt = [{"role": "user", "content": "one two " * 20}]  # one 40-odd-token step: over the largest bucket
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    assert pieces.stats == {"replays": 0, "captures": 0, "misses": 1, "deepstack_replays": 0} and not pieces.buckets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fixture", ["demo_model_dir", "qwen3_model_dir", "gemma4_model_dir", "qwen3_5_model_dir"])
def test_captured_pieces_give_the_eager_tokens_on_cuda(fixture: str, request: pytest.FixtureRequest) -> None:
    """float32 on CUDA, so the graphs and the eager forward differ by rounding only and greedy tokens must agree.
    Qwen3-VL captures a second set of pieces per bucket, for its image steps' DeepStack features; Gemma 4's sliding
    and global layers attend between the pieces with their own windows, tables and head shapes. (The MoE families
    capture in bf16 only, where their experts run as grouped GEMMs with no host sync.)"""
    model_dir: Path = request.getfixturevalue(fixture)
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", chunk_size=40,
                                 lone_prefill_tokens=0, piecewise_graph_tokens=48,
                                 enable_prefix_caching=False))
    pieces = engine.runner.piecewise
    sets = 1 + (_levels(engine) > 0)
    assert pieces is not None
    assert pieces.stats["captures"] == sets * len(token_buckets(48)) * (engine.runner.spec.num_layers + 1)
    # Replayed layers run no forward hook, so the worker's launch poll runs after each split call instead.
    assert pieces.poll is engine.runner.launch_poll
    polls: list[int] = []
    pieces.poll = lambda: polls.append(1)
    with_graphs = [o.token_ids for o in engine.generate(_prompts(), GREEDY)]
    assert pieces.stats["replays"] > 0 and (pieces.stats["deepstack_replays"] > 0) == (sets == 2)
    assert len(polls) == pieces.stats["replays"] * len(pieces.layers)
    engine.runner.piecewise = None
    assert [o.token_ids for o in engine.generate(_prompts(), GREEDY)] == with_graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_error_of_the_workers_poll_is_not_taken_for_the_graphs(demo_model_dir: Path) -> None:
    """The poll runs inside a replay, whose RuntimeErrors turn the pieces off: one of its own must go up as it is."""
    engine = Engine(EngineConfig(model=str(demo_model_dir), device="cuda", dtype="float32", chunk_size=40,
                                 lone_prefill_tokens=0, piecewise_graph_tokens=48, enable_prefix_caching=False))
    pieces = engine.runner.piecewise
    assert pieces is not None

    def fail() -> None:
        raise RuntimeError("the worker's report failed")

    pieces.poll = fail
    with pytest.raises(RuntimeError, match="the worker's report failed"):
        engine.generate(_prompts(), GREEDY)
    assert not pieces.broken


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_that_cannot_be_captured_serves_eagerly_on_cuda(qwen3_moe_model_dir: Path) -> None:
    """Qwen3-VL-MoE in float32 runs its experts in a loop that syncs with the host, which no capture allows: the
    worker starts without graphs, never having tried one (a failed capture would break every sampled request)."""
    engine = Engine(EngineConfig(model=str(qwen3_moe_model_dir), device="cuda", dtype="float32"))
    assert engine.runner.graphs is None and engine.runner.piecewise is None
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    out = engine.generate(_prompts()[:2], [GREEDY, sampled])
    assert [len(o.token_ids) for o in out] == [10, 10]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_blocks_say_whether_a_graph_can_hold_them(dtype: torch.dtype) -> None:
    """Only the grouped experts (CUDA, bf16) have no host sync; the loop (CPU, float32, or forced) has."""
    block = SparseMoeBlock(64, 4, 2, 32).to(dtype)
    assert not block.capturable()  # on the CPU: the loop
    if torch.cuda.is_available():
        block = block.cuda()
        assert block.capturable() == (dtype == torch.bfloat16)
        block.use_grouped = False
        assert not block.capturable()
