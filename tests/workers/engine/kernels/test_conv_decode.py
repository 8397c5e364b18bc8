"""The Triton causal conv of an all-decode step (conv_decode.py) against the torch path that the exactness tests tie
to transformers (gated_delta.causal_conv1d on the CPU): on the CPU through Triton's interpreter (the kernel's own
code, float32), on CUDA compiled, through the dispatch of gated_delta.causal_conv1d."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.workers.engine.kernels.gated_delta_harness import make_meta
from tests.workers.engine.kernels.kernel_check import check_switch_turns_it_off, run_kernel_check
from workers.engine.kernels import conv_decode, gated_delta

# Four decode rows; slot 1 holds NaN and belongs to a sequence without state; two snapshots of the window after the
# token (one of a sequence without state).
SLOTS, HAS_INITIAL = [3, 1, 0, 5], [True, False, True, True]
SNAPSHOTS = [(2, 1, 6), (1, 1, 4)]


def inputs(channels: int, kernel: int = 4, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x as a strided view (the in-projection's split gives it so), weight [C, K], a bias, a pool of 8 slots."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(len(SLOTS), channels + 24, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen) * 0.5
    bias = torch.randn(channels, generator=gen) * 0.1
    pool = torch.randn(8, channels, kernel - 1, generator=gen)
    pool[1] = float("nan")
    return wide[:, 8 : 8 + channels], weight, bias, pool


CHECK = """
import torch
from tests.workers.engine.kernels.gated_delta_harness import make_meta
from tests.workers.engine.kernels.test_conv_decode import HAS_INITIAL, SLOTS, SNAPSHOTS, inputs
from workers.engine.kernels import conv_decode, gated_delta

touched = SLOTS + [s for _, _, s in SNAPSHOTS]
# channels over one block and not a multiple of it, and under one; kernel widths 4 (Qwen3.5), 3 and 2 (a window of
# one column); bias or none; SiLU or none; a column-major weight.
for channels, kernel, with_bias, activation in ((300, 4, False, "silu"), (40, 3, True, None), (520, 2, True, "silu")):
    x, weight, bias, pool = inputs(channels, kernel, seed=channels)
    if channels == 40:  # a weight whose taps are not adjacent in memory
        weight = weight.t().contiguous().t()
    b = bias if with_bias else None
    fresh, want_pool = pool.clone(), pool.clone()
    meta = make_meta([1] * len(SLOTS), SLOTS, HAS_INITIAL, SNAPSHOTS)
    want = gated_delta.causal_conv1d(x, weight, b, want_pool, meta, activation=activation)
    got = conv_decode.decode_step(x, weight, b, pool, meta.state, activation is not None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[touched], want_pool[touched], rtol=0, atol=0)
    others = [s for s in range(pool.shape[0]) if s not in touched]
    assert torch.equal(pool[others], fresh[others])  # no other slot written
"""


def test_the_kernel_gives_the_torch_paths_conv_and_windows_in_triton_interpreter() -> None:
    run_kernel_check(CHECK, "conv_decode", "float32", timeout=300)


def test_a_conv_without_a_window_is_refused() -> None:
    x, weight, _, pool = inputs(8, kernel=2)
    st = make_meta([1] * 4, SLOTS, HAS_INITIAL).state
    assert st is not None
    with pytest.raises(ValueError, match="no window"):
        conv_decode.decode_step(x, weight[:, :1], None, pool[:, :, :0], st, True)


def test_the_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    check_switch_turns_it_off(monkeypatch, conv_decode)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_a_decode_steps_conv_takes_it(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    conv_decode.SWITCH.reset()
    assert conv_decode.probe(torch.device("cuda"), dtype), conv_decode.SWITCH.why_off()
    x, weight, _, pool = inputs(8192)  # Qwen3.5-9B's conv channels
    want_pool = pool.clone()
    want = gated_delta.causal_conv1d(x, weight, None, want_pool, make_meta([1] * 4, SLOTS, HAS_INITIAL, SNAPSHOTS))
    calls: list[int] = []
    real = conv_decode.decode_step

    def counted(*args: object, **kwargs: object) -> Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(conv_decode, "decode_step", counted)
    dev_pool = pool.cuda().to(dtype)
    got = gated_delta.causal_conv1d(x.cuda().to(dtype), weight.cuda().to(dtype), None, dev_pool,
                                    make_meta([1] * 4, SLOTS, HAS_INITIAL, SNAPSHOTS, device="cuda"), fuse=True)
    assert calls == [1]  # before the compiled path the layer's fused flag would take
    tol = 1e-4 if dtype == torch.float32 else 6e-2  # bf16 inputs, weights and pool against a float32 reference
    touched = SLOTS + [s for _, _, s in SNAPSHOTS]
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(dev_pool.float().cpu()[touched], want_pool[touched], rtol=tol, atol=tol)
