"""The FP8 KV cache's CUDA paths (marked gpu: skipped without CUDA). Each backend over an FP8 cache against the same
backend over a bf16 cache holding the dequantized values: Triton paged decode (in place, per-head scales), flash
varlen (decode rows in place, chunks over dequantized gathers, windows), FA3 over dequantized pages where a build
is installed, the CUDA-graph decode; the write kernel's bytes; decode graphs that capture the quantizing write and
the FP8 read give the eager tokens; Gemma 4 (two pools, sliding windows) and Qwen3.5 (hybrid) serve on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from ipc.prompts import SamplingParams
from tests.workers.engine.kernels.test_paged_attention import cuda_step
from workers.engine.config import EngineConfig
from workers.engine.kernels import kv_quant, kv_write_kernel, paged_attention
from workers.engine.kernels.attention import AttentionMetadata
from workers.engine.kernels.backends import get_attention_backend
from workers.engine.kernels.fa3_attention import unavailable_reason
from workers.engine.kernels.torch_attention import FlashVarlenBackend, PaddedDecodeBackend
from workers.engine.offline import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
HQ, HKV, D = 28, 4, 128  # a 7B's heads


def fp8_and_float(cache: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(FP8 cache with per-head scales, bf16 cache holding its dequantized values, k and v rounded the same way)."""
    scales = torch.linspace(0.002, 0.05, 2 * HKV, device="cuda").view(2, HKV)
    fp8 = torch.stack([kv_quant.quantize(cache[i], scales[i]) for i in (0, 1)])
    kv_quant.attach_scales(fp8, scales)

    def back(x: Tensor, i: int) -> Tensor:  # the round trip, written out: e4m3 -> float32 * scale -> bf16
        q = (x.float() / scales[i][:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        return (q.float() * scales[i][:, None]).to(torch.bfloat16)

    return fp8, torch.stack([back(cache[i], i) for i in (0, 1)]), back(k, 0), back(v, 1)


def compare(backend: object, query_lens: list[int], seq_lens: list[int], window: int = 0) -> None:
    torch.manual_seed(0)
    q, k, v, cache, meta = cuda_step(query_lens, seq_lens, 16, 1200)
    fp8, plain, rk, rv = fp8_and_float(cache * 0.05, k * 0.05, v * 0.05)
    out = backend.forward(q, k * 0.05, v * 0.05, fp8, meta, D**-0.5, window)  # type: ignore[attr-defined]
    meta2 = AttentionMetadata(**{**meta.__dict__, "derived": {}})
    want = backend.forward(q, rk, rv, plain, meta2, D**-0.5, window)  # type: ignore[attr-defined]
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [0, 100])
def test_flash_backend_mixed_step_over_fp8(window: int) -> None:
    compare(FlashVarlenBackend(), [1] * 12 + [300, 40], [int(n) for n in torch.randint(1, 900, (12,))] + [700, 40],
            window)


@pytest.mark.parametrize("window", [0, 100])
def test_graph_decode_backend_over_fp8(window: int) -> None:
    compare(PaddedDecodeBackend(), [1] * 9, [int(n) for n in torch.randint(1, 900, (9,))], window)


@pytest.mark.skipif(bool(unavailable_reason(torch.device("cuda"))) if torch.cuda.is_available() else True,
                    reason="needs an FA3 build")
def test_fa3_over_dequantized_pages() -> None:
    compare(get_attention_backend("fa3", "cuda"), [1] * 6 + [300], [400, 20, 90, 600, 33, 5, 500])


def test_triton_paged_decode_probe_passes_for_fp8() -> None:
    """The start-up probe with an FP8 cache: the kernel's e4m3 loads compile and match (else decode would gather)."""
    assert paged_attention.probe(torch.device("cuda"), torch.bfloat16, HQ, HKV, D, sliding=True,
                                 kv_dtype=kv_quant.FP8)
    assert paged_attention.usable(torch.zeros(1, HQ, D, device="cuda", dtype=torch.bfloat16))


def test_write_kernel_stores_the_quantized_bytes() -> None:
    torch.manual_seed(1)
    k, v = torch.randn(2, 33, HKV, D, device="cuda", dtype=torch.bfloat16) * 3
    cache = torch.zeros(2, 10, 16, HKV, D, device="cuda", dtype=kv_quant.FP8)
    scales = torch.rand(2, HKV, device="cuda") + 0.01
    kv_quant.attach_scales(cache, scales)
    slots = torch.randperm(160, device="cuda")[:33]
    kv_write_kernel.write_kv_cache(k, v, cache, slots)
    flat = cache.view(2, -1, HKV, D).view(torch.uint8)
    for i, x in enumerate((k, v)):
        assert torch.equal(flat[i, slots], kv_quant.quantize(x, scales[i]).view(torch.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graphs_capture_the_fp8_write_and_read(demo_model_dir: Path, dtype: str) -> None:
    """float32: the gather decode path, graphs and eager differ by rounding only; bfloat16: the Triton kernel reads
    e4m3 in place (its split plan follows the padded bucket, so only the first tokens must agree)."""
    engine = Engine(EngineConfig(model=str(demo_model_dir), device="cuda", dtype=dtype, kv_cache_dtype="fp8"))
    n = 24 if dtype == "float32" else 8
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    prompts = [[{"role": "user", "content": f"Count to {n}: " + "one " * n}] for n in (3, 20, 40)]
    graphs = engine.runner.graphs
    assert graphs is not None and engine.runner.kv_caches[0].dtype == kv_quant.FP8
    with_graphs = [o.token_ids for o in engine.generate(prompts, greedy)]
    assert graphs.stats["replays"] > 0 and graphs.stats["captures"] > 0
    engine.runner.graphs = None
    engine.runner.piecewise = None
    assert [o.token_ids for o in engine.generate(prompts, greedy)] == with_graphs


@pytest.mark.parametrize("family", ["gemma4_model_dir", "qwen3_5_model_dir", "qwen3_model_dir"])
def test_families_serve_over_fp8_on_cuda(family: str, request: pytest.FixtureRequest) -> None:
    """Gemma 4's two pools and windows, Qwen3.5's FP8 attention caches beside its state pools (model dtype),
    Qwen3-VL: on CUDA in float32 the same greedy tokens as the CPU engine with FP8 caches (which the CPU tests hold
    to transformers), and four times the blocks of a float32 cache in the same budget."""
    model = request.getfixturevalue(family)
    prompt = [[{"role": "user", "content": "Describe the chart on page three."}]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    gpu = Engine(EngineConfig(model=str(model), device="cuda", dtype="float32", kv_cache_dtype="fp8", kv_cache_mb=64))
    plain = Engine(EngineConfig(model=str(model), device="cuda", dtype="float32", kv_cache_mb=64))
    if plain.runner.num_window_blocks:
        # Two pools (Gemma 4), each rounded down to whole blocks out of its share of the budget: a few blocks either
        # way of four times, in both.
        assert abs(gpu.runner.num_window_blocks - 4 * plain.runner.num_window_blocks) <= 8
        assert abs(gpu.runner.num_blocks - 4 * plain.runner.num_blocks) <= 8
    else:
        assert 0 <= gpu.runner.num_blocks - 4 * plain.runner.num_blocks <= 3
    if gpu.runner.state is not None:
        assert {p.dtype for p in gpu.runner.state.pools} == {torch.float32}
    cpu = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32", kv_cache_dtype="fp8",
                              num_kv_blocks=512))
    assert gpu.generate(prompt, greedy)[0].token_ids == cpu.generate(prompt, greedy)[0].token_ids
