"""Attention over an FP8 KV cache (--kv-cache-dtype fp8) equals attention over a float cache holding the same
e4m3 round-tripped values, for every backend the CPU can drive: SDPA, the flash backend's own work (packed and
windowed gathers, span rows) around a reference kernel, FA3's gathered pages around its reference kernel, the
CUDA-graph decode, and the Triton paged decode and KV write under Triton's interpreter. Steps cover prefill chunks
over a cached prefix, decode rows, sliding windows and bidirectional image spans (window_scenarios' CASES).

The round trip here is written apart from workers/engine/kernels/kv_quant.py (float64, its own saturation), and
per-head scales are small enough that some values saturate at +-448 * scale."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from tests.workers.engine.interpreted import run_interpreted
from tests.workers.engine.kernels.test_fa3_attention import mixed_step, reference_kernel
from tests.workers.engine.kernels.test_window_attention_masks import CASES
from tests.workers.engine.kernels.window_scenarios import Seq, Step, cpu_flash_backend, make_step, reference
from workers.engine.kernels import kv_quant
from workers.engine.kernels.attention import build_attention_metadata
from workers.engine.kernels.fa3_attention import FA3PagedBackend
from workers.engine.kernels.kv_write_kernel import write_kv_cache
from workers.engine.kernels.torch_attention import PaddedDecodeBackend, SdpaBackend

D = 16
SCALE = D**-0.5
SCALES = torch.tensor([[0.004, 0.5], [0.02, 2.0]])  # [K, V] x 2 KV heads; 0.004: values past 1.8 saturate


def round_trip(x: Tensor, scales: Tensor) -> Tensor:
    """e4m3 round trip of x [..., H, D] with per-head ``scales`` [H], in float64: x / s, saturated at 448, to e4m3,
    back, times s."""
    s = scales.double()[:, None]
    return (x.double() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).double() * s


def fp8_step(step: Step) -> tuple[Tensor, Step]:
    """The step's cache in FP8 (scales attached) and the same step whose every K/V is the round-tripped value."""
    cache = torch.stack([kv_quant.quantize(step.cache[i], SCALES[i]) for i in (0, 1)])
    kv_quant.attach_scales(cache, SCALES.clone())
    rounded = dataclasses.replace(
        step,
        full_k=[round_trip(k, SCALES[0]).float() for k in step.full_k],
        full_v=[round_trip(v, SCALES[1]).float() for v in step.full_v],
    )
    return cache, rounded


def check(backend: object, case: str) -> None:
    seqs, window, bidirectional = CASES[case]
    step = make_step(seqs, seed=len(case))
    cache, rounded = fp8_step(step)
    out = backend.forward(step.q, step.k, step.v, cache, step.meta, SCALE, window, bidirectional)  # type: ignore[attr-defined]
    want = reference(rounded, SCALE, window, bidirectional)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # The rounding is visible at this tolerance: attention over the unrounded K/V is another answer.
    assert not torch.allclose(out, reference(step, SCALE, window, bidirectional), atol=1e-3)
    # The new tokens' K/V went into their slots in e4m3: the cache reads back their round trip.
    flat = (cache.view(2, -1, 2, D).double() * SCALES.double().view(2, 1, 2, 1)).float()
    new_k = torch.cat([k[s.context :] for k, s in zip(rounded.full_k, seqs, strict=True)])
    assert torch.equal(flat[0, step.meta.slot_mapping], new_k)


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_over_fp8_cache_equals_sdpa_over_rounded_values(case: str) -> None:
    check(SdpaBackend(), case)


@pytest.mark.parametrize("case", list(CASES))
def test_flash_backend_gathers_dequantize_the_fp8_cache(case: str) -> None:
    """Packed and windowed gathers, decode rows (the gather path here: no Triton) and span rows, with the reference
    varlen kernel; a fresh prompt's rows read the cache too, not the unrounded k, v."""
    check(cpu_flash_backend(), case)


def test_fa3_reads_dequantized_pages_of_the_fp8_cache() -> None:
    q, k, v, cache, meta = mixed_step("cpu", torch.bfloat16)
    float_cache = torch.stack([round_trip(cache[i].float(), SCALES[i]) for i in (0, 1)]).to(torch.bfloat16)
    fp8 = torch.stack([kv_quant.quantize(cache[i], SCALES[i]) for i in (0, 1)])
    kv_quant.attach_scales(fp8, SCALES.clone())
    backend = FA3PagedBackend(kernel=reference_kernel, any_device=True)
    out = backend.forward(q, k, v, fp8, meta, D**-0.5)
    rk, rv = (round_trip(t.float(), SCALES[i]).to(torch.bfloat16) for i, t in enumerate((k, v)))
    want = backend.forward(q, rk, rv, float_cache, meta, D**-0.5)
    torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert not torch.allclose(out.float(), backend.forward(q, k, v, cache, meta, D**-0.5).float(), atol=5e-2)


@pytest.mark.parametrize("window", [0, 3])
def test_graph_decode_over_fp8_cache(window: int) -> None:
    """PaddedDecodeBackend (CUDA graphs' decode; on the CPU its masked SDPA over the padded gather)."""
    seqs = [Seq(12, 1), Seq(3, 1), Seq(7, 1)]
    step = make_step(seqs, seed=5)
    cache, rounded = fp8_step(step)
    out = PaddedDecodeBackend().forward(step.q, step.k, step.v, cache, step.meta, SCALE, window)
    torch.testing.assert_close(out, reference(rounded, SCALE, window), atol=1e-5, rtol=1e-5)


def test_scales_are_checked_and_never_guessed() -> None:
    cache = torch.zeros(2, 3, 4, 2, D, dtype=kv_quant.FP8)
    with pytest.raises(RuntimeError, match="without scales"):
        kv_quant.scales_of(cache)
    with pytest.raises(RuntimeError, match="without scales"):  # a view does not carry them
        kv_quant.attach_scales(cache, SCALES.clone())
        write_kv_cache(torch.ones(1, 2, D), torch.ones(1, 2, D), cache[:, :2], torch.tensor([0]))
    with pytest.raises(ValueError, match="positive"):
        kv_quant.attach_scales(cache, torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"\[2, 2\]"):
        kv_quant.attach_scales(cache, torch.ones(2, 3))


def test_saturation_keeps_values_finite() -> None:
    """torch's e4m3 cast is not saturating (out of range: NaN); the cache write must clamp."""
    cache = torch.zeros(2, 1, 4, 2, D, dtype=kv_quant.FP8)
    kv_quant.attach_scales(cache, torch.ones(2, 2))
    big = torch.full((1, 2, D), 1e6)
    write_kv_cache(big, -big, cache, torch.tensor([2]))
    assert cache[0, 0, 2].float().eq(448).all() and cache[1, 0, 2].float().eq(-448).all()
    meta = build_attention_metadata([1], [3], [[0]], 4)
    assert torch.isfinite(SdpaBackend().forward(torch.ones(1, 2, D), None, None, cache, meta, SCALE)).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the kernels themselves")
def test_triton_paged_decode_and_write_over_fp8_in_interpreter() -> None:
    run_interpreted("-m", "tests.workers.engine.kernels.fp8_kv_check")


def test_block_copies_move_the_fp8_bytes() -> None:
    """copy_kv_blocks (a fork's partial block, window pools) on an FP8 cache copies the e4m3 bytes as they are."""
    from workers.engine.runner.cache_memory import copy_kv_blocks

    cache = (torch.randn(2, 5, 4, 2, D) * 10).to(kv_quant.FP8)
    before = cache.clone()
    copy_kv_blocks([cache], None, [(1, 4), (0, 2)], [], torch.device("cpu"))
    raw, old = cache.view(torch.uint8), before.view(torch.uint8)
    assert torch.equal(raw[:, 4], old[:, 1]) and torch.equal(raw[:, 2], old[:, 0])
    assert torch.equal(raw[:, [0, 1, 3]], old[:, [0, 1, 3]])
