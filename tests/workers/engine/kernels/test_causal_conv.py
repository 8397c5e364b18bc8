"""The Triton causal conv over a step's new tokens (causal_conv.py) against the torch path that the exactness tests
tie to transformers (gated_delta.causal_conv1d on the CPU): on the CPU through Triton's interpreter (the kernel's own
code, float32), on CUDA compiled, in both pool dtypes, through the dispatch of gated_delta.causal_conv1d."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from torch import Tensor

from tests.workers.engine.kernels.gated_delta_harness import make_meta
from tests.workers.engine.kernels.kernel_check import check_switch_turns_it_off, run_kernel_check
from workers.engine.kernels import causal_conv, gated_delta
from workers.engine.kernels.attention import AttentionMetadata

# Sequences of 1 (a decode row), 2 (shorter than the window), 37 and 70 tokens (several token tiles); slot 1 holds
# NaN and belongs to a sequence without state; snapshots after fewer and more tokens than the window.
LENS, SLOTS, HAS_INITIAL = [1, 2, 37, 70], [3, 1, 0, 5], [True, False, True, True]
SNAPSHOTS = [(2, 1, 6), (1, 2, 2), (3, 64, 4), (2, 30, 7)]


def inputs(channels: int, kernel: int = 4, seed: int = 0, rows: int = sum(LENS)) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [rows, C] as a strided view (a projection's split gives it so), weight [C, K], a bias, a pool of 10 slots."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, channels + 24, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen) * 0.5
    bias = torch.randn(channels, generator=gen) * 0.1
    pool = torch.randn(10, channels, kernel - 1, generator=gen)
    pool[1] = float("nan")
    return wide[:, 8 : 8 + channels], weight, bias, pool


@dataclass
class ConvCase:
    """One interpreter case: inputs, the torch path's answer and windows, and the pool before either ran."""

    x: Tensor
    weight: Tensor
    bias: Tensor | None
    silu: bool
    pool: Tensor  # for the kernel under test to write
    fresh: Tensor
    want: Tensor
    want_pool: Tensor
    meta: AttentionMetadata
    touched: list[int]

    def check(self, got: Tensor) -> None:
        """The kernel's output against the torch path's; its windows equal bit for bit; no other slot written."""
        torch.testing.assert_close(got, self.want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(self.pool[self.touched], self.want_pool[self.touched], rtol=0, atol=0)
        others = [s for s in range(self.pool.shape[0]) if s not in self.touched]
        assert torch.equal(self.pool[others], self.fresh[others])


def conv_cases(lens: list[int], slots: list[int], has_initial: list[bool], snapshots: list[tuple[int, int, int]],
               shapes: tuple[tuple[int, int, bool, str | None], ...]) -> Iterator[ConvCase]:  # fmt: skip
    """A ConvCase per (channels, kernel width, bias, activation); the 40-channel one with a column-major weight."""
    for channels, kernel, with_bias, activation in shapes:
        x, weight, bias, pool = inputs(channels, kernel, seed=channels, rows=sum(lens))
        if channels == 40:  # a weight whose taps are not adjacent in memory
            weight = weight.t().contiguous().t()
        b = bias if with_bias else None
        fresh, want_pool = pool.clone(), pool.clone()
        meta = make_meta(lens, slots, has_initial, snapshots)
        want = gated_delta.causal_conv1d(x, weight, b, want_pool, meta, activation=activation)
        yield ConvCase(x, weight, b, activation is not None, pool, fresh, want, want_pool, meta,
                       slots + [s for _, _, s in snapshots])  # fmt: skip


CHECK = """
import torch
from tests.workers.engine.kernels.test_causal_conv import HAS_INITIAL, LENS, SECTIONS, SLOTS, SNAPSHOTS, conv_cases
from workers.engine.kernels import causal_conv

# channels over one tile and not a multiple of it, and under one; kernel widths 4 (Qwen3.5) and 3; bias or none;
# SiLU or none; a column-major weight.
shapes = ((136, 4, False, "silu"), (40, 3, True, None), (200, 4, True, "silu"))
for case in conv_cases(LENS, SLOTS, HAS_INITIAL, SNAPSHOTS, shapes):
    x, weight, b, silu, meta = case.x, case.weight, case.bias, case.silu, case.meta
    starts = meta.query_start_loc.tolist()[:-1]
    got = causal_conv.conv(x, weight, b, case.pool, meta.state, meta.query_start_loc, starts, silu)
    case.check(got)
    # the step's row-to-sequence map made once and handed to every layer gives the same answer and windows
    seq_of = torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS))
    again = case.fresh.clone()
    got2 = causal_conv.conv(x, weight, b, again, meta.state, meta.query_start_loc, starts, silu, seq_of)
    assert torch.equal(got2, got) and torch.equal(again, case.pool)
    # the same conv stored as channel sections (q, k, v): boundaries inside a 128-channel tile and on one
    for sections in SECTIONS[x.shape[1]]:
        into = case.fresh.clone()
        parts = causal_conv.conv_sections(x, weight, b, into, meta.state, meta.query_start_loc, starts, silu, sections)
        assert [p.shape for p in parts] == [(x.shape[0], w) for w in sections]
        assert all(p.is_contiguous() for p in parts)
        assert torch.equal(torch.cat(parts, dim=1), got) and torch.equal(into, case.pool)
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


def test_a_conv_wider_than_the_kernels_registers_stays_on_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel keeps MAX_KERNEL - 1 inputs in registers: a wider conv is refused by it by name and never dispatched
    to it (the torch path takes any width)."""
    x, _, _, pool = inputs(24)
    wide = torch.randn(24, causal_conv.MAX_KERNEL + 1)
    meta = make_meta(LENS, SLOTS, HAS_INITIAL)
    with pytest.raises(ValueError, match="conv kernel width"):
        causal_conv.conv(x, wide, None, torch.zeros(10, 24, causal_conv.MAX_KERNEL), meta.state, meta.query_start_loc,
                         [0, 1, 3, 40], True)  # fmt: skip
    monkeypatch.setattr(gated_delta, "_on_triton", lambda x, activation: True)  # as on CUDA
    monkeypatch.setattr(causal_conv, "available", lambda: True)
    assert gated_delta._triton_conv(x, torch.randn(24, causal_conv.MAX_KERNEL), "silu", meta)
    assert not gated_delta._triton_conv(x, wide, "silu", meta)


def test_the_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    check_switch_turns_it_off(monkeypatch, causal_conv)


def served_on_cuda(
    monkeypatch: pytest.MonkeyPatch, kernel: ModuleType, entry: str, lens: list[int], slots: list[int],
    has_initial: list[bool], snapshots: list[tuple[int, int, int]], channels: int, dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """gated_delta.causal_conv1d on CUDA (the layer's fused flag set, as served) with ``kernel.<entry>`` counted: it
    must take that kernel once and give the CPU torch path's output and windows (to bf16's rounding). Returns x, the
    weight and the starting pool on the CUDA device, the output and the pool after."""
    kernel.SWITCH.reset()
    assert kernel.probe(torch.device("cuda"), dtype), kernel.SWITCH.why_off()
    x, weight, _, pool = inputs(channels, rows=sum(lens))
    want_pool = pool.clone()
    want = gated_delta.causal_conv1d(x, weight, None, want_pool, make_meta(lens, slots, has_initial, snapshots))
    calls: list[int] = []
    real = getattr(kernel, entry)

    def counted(*args: object, **kwargs: object) -> Tensor:
        calls.append(1)
        out: Tensor = real(*args, **kwargs)
        return out

    monkeypatch.setattr(kernel, entry, counted)
    dx, dw, dev_pool = x.cuda().to(dtype), weight.cuda().to(dtype), pool.cuda().to(dtype)
    got = gated_delta.causal_conv1d(dx, dw, None, dev_pool,
                                    make_meta(lens, slots, has_initial, snapshots, device="cuda"), fuse=True)
    assert calls == [1]
    tol = 1e-4 if dtype == torch.float32 else 6e-2  # bf16 inputs, weights and pool against a float32 reference
    touched = slots + [s for _, _, s in snapshots]
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(dev_pool.float().cpu()[touched], want_pool[touched], rtol=tol, atol=tol)
    return dx, dw, pool.cuda().to(dtype), got, dev_pool


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_a_prefill_steps_conv_takes_it(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # Qwen3.5-27B's conv channels
    x, weight, again, got, pool = served_on_cuda(monkeypatch, causal_conv, "conv", LENS, SLOTS, HAS_INITIAL, SNAPSHOTS,
                                                 10240, dtype)  # fmt: skip
    # as q, k, v of the 27B (16 key heads of 128, 48 value heads of 128): contiguous, the same values
    parts = gated_delta.causal_conv1d_sections(x, weight, None, again,
                                               make_meta(LENS, SLOTS, HAS_INITIAL, SNAPSHOTS, device="cuda"),
                                               (2048, 2048, 6144))  # fmt: skip
    assert all(p.is_contiguous() for p in parts)
    assert torch.equal(torch.cat(parts, dim=1), got) and torch.equal(again, pool)
