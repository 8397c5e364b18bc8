"""The Triton causal conv of an all-decode step (conv_decode.py) against the torch path that the exactness tests tie
to transformers (gated_delta.causal_conv1d on the CPU): on the CPU through Triton's interpreter (the kernel's own
code, float32), on CUDA compiled, through the dispatch of gated_delta.causal_conv1d."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.workers.engine.kernels.gated_delta_harness import make_meta
from tests.workers.engine.kernels.kernel_check import check_switch_turns_it_off, run_kernel_check
from tests.workers.engine.kernels.test_causal_conv import inputs as causal_conv_inputs, served_on_cuda
from workers.engine.kernels import conv_decode

# Four decode rows; slot 1 holds NaN and belongs to a sequence without state; two snapshots of the window after the
# token (one of a sequence without state).
SLOTS, HAS_INITIAL = [3, 1, 0, 5], [True, False, True, True]
SNAPSHOTS = [(2, 1, 6), (1, 1, 4)]


def inputs(channels: int, kernel: int = 4, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """test_causal_conv's inputs, one row per sequence here."""
    return causal_conv_inputs(channels, kernel, seed, rows=len(SLOTS))


CHECK = """
from tests.workers.engine.kernels.test_causal_conv import conv_cases
from tests.workers.engine.kernels.test_conv_decode import HAS_INITIAL, SLOTS, SNAPSHOTS
from workers.engine.kernels import conv_decode

# channels over one block and not a multiple of it, and under one; kernel widths 4 (Qwen3.5), 3 and 2 (a window of
# one column); bias or none; SiLU or none; a column-major weight.
shapes = ((300, 4, False, "silu"), (40, 3, True, None), (520, 2, True, "silu"))
for case in conv_cases([1] * len(SLOTS), SLOTS, HAS_INITIAL, SNAPSHOTS, shapes):
    assert case.meta.state is not None
    case.check(conv_decode.decode_step(case.x, case.weight, case.bias, case.pool, case.meta.state, case.silu))
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
    """Taken before the compiled path the layer's fused flag would take; Qwen3.5-9B's conv channels."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    served_on_cuda(monkeypatch, conv_decode, "decode_step", [1] * len(SLOTS), SLOTS, HAS_INITIAL, SNAPSHOTS, 8192, dtype)
