"""The Triton causal conv over a step's new tokens (causal_conv.py) against the torch path that the exactness tests
tie to transformers (gated_delta.causal_conv1d on the CPU): on the CPU through Triton's interpreter (the kernel's own
code, float32), on CUDA compiled, in both pool dtypes, through the dispatch of gated_delta.causal_conv1d."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.workers.engine.kernels.gated_delta_harness import make_meta
from tests.workers.engine.kernels.kernel_check import check_switch_turns_it_off, run_kernel_check
from workers.engine.kernels import causal_conv, gated_delta

# Sequences of 1 (a decode row), 2 (shorter than the window), 37 and 70 tokens (several token tiles); slot 1 holds
# NaN and belongs to a sequence without state; snapshots after fewer and more tokens than the window.
LENS, SLOTS, HAS_INITIAL = [1, 2, 37, 70], [3, 1, 0, 5], [True, False, True, True]
SNAPSHOTS = [(2, 1, 6), (1, 2, 2), (3, 64, 4), (2, 30, 7)]


def inputs(channels: int, kernel: int = 4, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x as a strided view (a projection's split gives it so), weight [C, K], a bias, a pool of 10 slots."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(sum(LENS), channels + 24, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen) * 0.5
    bias = torch.randn(channels, generator=gen) * 0.1
    pool = torch.randn(10, channels, kernel - 1, generator=gen)
    pool[1] = float("nan")
    return wide[:, 8 : 8 + channels], weight, bias, pool


CHECK = """
import torch
from tests.workers.engine.kernels.gated_delta_harness import make_meta
from tests.workers.engine.kernels.test_causal_conv import HAS_INITIAL, LENS, SECTIONS, SLOTS, SNAPSHOTS, inputs
from workers.engine.kernels import causal_conv, gated_delta

touched = SLOTS + [s for _, _, s in SNAPSHOTS]
# channels over one tile and not a multiple of it, and under one; kernel widths 4 (Qwen3.5) and 3; bias or none;
# SiLU or none; a column-major weight.
for channels, kernel, with_bias, activation in ((136, 4, False, "silu"), (40, 3, True, None), (200, 4, True, "silu")):
    x, weight, bias, pool = inputs(channels, kernel, seed=channels)
    if channels == 40:  # a weight whose taps are not adjacent in memory
        weight = weight.t().contiguous().t()
    b = bias if with_bias else None
    fresh, want_pool = pool.clone(), pool.clone()
    meta = make_meta(LENS, SLOTS, HAS_INITIAL, SNAPSHOTS)
    want = gated_delta.causal_conv1d(x, weight, b, want_pool, meta, activation=activation)
    starts = meta.query_start_loc.tolist()[:-1]
    got = causal_conv.conv(x, weight, b, pool, meta.state, meta.query_start_loc, starts, activation is not None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[touched], want_pool[touched], rtol=0, atol=0)
    others = [s for s in range(pool.shape[0]) if s not in touched]
    assert torch.equal(pool[others], fresh[others])  # no other slot written
    # the step's window plan made once and handed to every layer gives the same answer and windows
    plan = causal_conv.window_plan(meta.query_start_loc, kernel - 1)
    again = fresh.clone()
    got2 = causal_conv.conv(x, weight, b, again, meta.state, meta.query_start_loc, starts, activation is not None,
                            plan=plan)
    assert torch.equal(got2, got) and torch.equal(again, pool)
    # the same conv stored as channel sections (q, k, v): boundaries inside a 128-channel tile and on one
    for sections in SECTIONS[channels]:
        into = fresh.clone()
        parts = causal_conv.conv_sections(x, weight, b, into, meta.state, meta.query_start_loc, starts,
                                          activation is not None, sections)
        assert [p.shape for p in parts] == [(x.shape[0], w) for w in sections]
        assert all(p.is_contiguous() for p in parts)
        assert torch.equal(torch.cat(parts, dim=1), got) and torch.equal(into, pool)
# the start-up probe (three sections, NaN in a fresh slot) passes on the interpreter
causal_conv.SWITCH.reset()
assert causal_conv.probe(torch.device("cpu"), torch.float32), causal_conv.SWITCH.why_off()
"""

SECTIONS = {136: [(40, 40, 56), (128, 8)], 40: [(16, 24)], 200: [(64, 64, 72), (128, 72), (200,)]}


def test_the_kernel_gives_the_torch_paths_conv_and_windows_in_triton_interpreter() -> None:
    run_kernel_check(CHECK, "causal_conv", "float32", timeout=300)


@pytest.mark.parametrize("with_bias", [True, False])
def test_the_probes_reference_is_the_torch_path(with_bias: bool) -> None:
    x, weight, bias, pool = inputs(24)
    b = bias if with_bias else None
    want_pool = pool.clone()
    want = gated_delta.causal_conv1d(x, weight, b, want_pool, make_meta(LENS, SLOTS, HAS_INITIAL))
    got, got_pool = causal_conv.reference(x, weight, b, pool, LENS, SLOTS, HAS_INITIAL, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_pool[SLOTS], want_pool[SLOTS], rtol=0, atol=0)


def test_sections_off_the_kernel_are_the_convs_split() -> None:
    """Where the kernel does not serve (here: the CPU), the sections are the [T, C] result split by channels."""
    x, weight, bias, pool = inputs(24)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = gated_delta.causal_conv1d(x, weight, bias, want_pool, make_meta(LENS, SLOTS, HAS_INITIAL, SNAPSHOTS))
    parts = gated_delta.causal_conv1d_sections(x, weight, bias, got_pool, make_meta(LENS, SLOTS, HAS_INITIAL, SNAPSHOTS),
                                               (4, 4, 16))  # fmt: skip
    assert [tuple(p.shape) for p in parts] == [(sum(LENS), 4), (sum(LENS), 4), (sum(LENS), 16)]
    assert torch.equal(torch.cat(parts, dim=1), want) and torch.equal(got_pool.nan_to_num(), want_pool.nan_to_num())


@pytest.mark.parametrize("sections", [(4, 4), (0, 8, 16), (8, 8, 4, 4), (24, 8)])
def test_sections_must_be_one_to_three_widths_covering_the_channels(sections: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="conv sections"):
        causal_conv._bounds(sections, 24)


def test_the_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    check_switch_turns_it_off(monkeypatch, causal_conv)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_a_prefill_steps_conv_takes_it(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    causal_conv.SWITCH.reset()
    assert causal_conv.probe(torch.device("cuda"), dtype), causal_conv.SWITCH.why_off()
    x, weight, _, pool = inputs(10240)  # Qwen3.5-27B's conv channels
    want_pool = pool.clone()
    want = gated_delta.causal_conv1d(x, weight, None, want_pool, make_meta(LENS, SLOTS, HAS_INITIAL, SNAPSHOTS))
    calls: list[int] = []
    real = causal_conv.conv

    def counted(*args: object, **kwargs: object) -> Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(causal_conv, "conv", counted)
    dev_pool = pool.cuda().to(dtype)
    got = gated_delta.causal_conv1d(x.cuda().to(dtype), weight.cuda().to(dtype), None, dev_pool,
                                    make_meta(LENS, SLOTS, HAS_INITIAL, SNAPSHOTS, device="cuda"))  # fmt: skip
    assert calls == [1]
    tol = 1e-4 if dtype == torch.float32 else 6e-2  # bf16 inputs, weights and pool against a float32 reference
    touched = SLOTS + [s for _, _, s in SNAPSHOTS]
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(dev_pool.float().cpu()[touched], want_pool[touched], rtol=tol, atol=tol)
    # as q, k, v of the 27B (16 key heads of 128, 48 value heads of 128): contiguous, the same values
    again = pool.cuda().to(dtype)
    parts = gated_delta.causal_conv1d_sections(x.cuda().to(dtype), weight.cuda().to(dtype), None, again,
                                               make_meta(LENS, SLOTS, HAS_INITIAL, SNAPSHOTS, device="cuda"),
                                               (2048, 2048, 6144))  # fmt: skip
    assert all(p.is_contiguous() for p in parts) and calls == [1]  # conv_sections is not conv: no second count
    assert torch.equal(torch.cat(parts, dim=1), got) and torch.equal(again, dev_pool)
