"""The Triton window-attention kernel (the ViT's windowed blocks on CUDA): on the CPU through Triton's interpreter
against grouped SDPA (the ViT's CPU path), and on a GPU inside the ViT's attention layer against FlashAttention."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.kernels.kernel_check import run_kernel_check

CHECK = """
import torch
from itertools import accumulate
from workers.engine.kernels import window_attention
from workers.engine.layers.vision_attention import Segments, _grouped_sdpa

gen = torch.Generator().manual_seed(0)
# Segments as a 1080p frame's windows come (full 64s, ragged 48/16/12 at the edges), one-row segments, the 128-row
# limit; head sizes 80 (Qwen2.5-VL), 72 (Qwen3-VL), 64, 8 and 96; float32 to see the math, float16 as served
# (the interpreter's tl.dot mishandles bf16).
CASES = [
    ([64, 64, 48, 16, 64, 12], 3, 80),
    ([1, 7, 1, 33], 2, 72),
    ([128, 100, 3], 1, 64),
    ([16, 9], 2, 8),  # a head narrower than tl.dot's smallest K
    ([40, 64], 2, 96),
]
for dtype in (torch.float32, torch.float16):
    for lengths, heads, dim in CASES:
        n, bounds = sum(lengths), list(accumulate(lengths, initial=0))
        q, k, v = (torch.randn(n, heads, dim, generator=gen).to(dtype) for _ in range(3))
        seg = Segments(torch.tensor(bounds, dtype=torch.int32), bounds, max(lengths))
        want = _grouped_sdpa(q.float(), k.float(), v.float(), seg)
        got = window_attention.attend(q, k, v, seg.cu, seg.max_len, dim**-0.5)
        assert got.shape == (n, heads, dim) and got.dtype == dtype and got.is_contiguous()
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got.float(), want, **tol)
        # a segment only sees itself: changing another segment's keys leaves this one's output alone
        k2 = k.clone()
        k2[bounds[1]:] += 1
        again = window_attention.attend(q, k2, v, seg.cu, seg.max_len, dim**-0.5)
        assert torch.equal(again[: bounds[1]], got[: bounds[1]])
        assert not torch.equal(again[bounds[1]:], got[bounds[1]:])
# v as the fused qkv's strided slice (token stride 3 x H x D) reads the right elements
qkv = torch.randn(70, 3, 2, 16, generator=gen)
bounds = [0, 64, 70]
seg = Segments(torch.tensor(bounds, dtype=torch.int32), bounds, 64)
q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
torch.testing.assert_close(window_attention.attend(q, k, v, seg.cu, 64, 0.25),
                           _grouped_sdpa(q.contiguous(), k.contiguous(), v.contiguous(), seg), rtol=1e-4, atol=1e-4)
try:
    window_attention.attend(q, k, v, seg.cu, 129, 0.25)
except ValueError as exc:
    assert "129" in str(exc)
else:
    raise AssertionError("a segment over MAX_LEN must be refused")
"""


def test_kernel_matches_grouped_sdpa_under_the_interpreter() -> None:
    run_kernel_check(CHECK, "window_attention", "float16")


def test_wanted_only_for_short_segments_of_half_precision_on_cuda() -> None:
    from workers.engine.kernels import window_attention

    cpu = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    assert not window_attention.wanted(cpu, 64)  # the CPU keeps grouped SDPA (exactness against transformers)
    if torch.cuda.is_available() and window_attention.available():
        gpu = cpu.cuda()
        assert window_attention.wanted(gpu, 64) and window_attention.wanted(gpu, window_attention.MAX_LEN)
        assert not window_attention.wanted(gpu, window_attention.MAX_LEN + 1)
        assert not window_attention.wanted(gpu.float(), 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU runs it through the interpreter)")
def test_vit_windows_on_cuda_match_flash_attention() -> None:
    from itertools import accumulate

    from workers.engine.kernels import window_attention
    from workers.engine.layers.vision_attention import Segments, _varlen

    assert window_attention.probe(torch.device("cuda"), torch.bfloat16), window_attention.SWITCH.why_off()
    rows, cols = 39, 69  # a 1080p frame's windows: 8 x 8 patches, ragged at the right and bottom edges
    lengths = [min(4, rows - r) * min(4, cols - c) * 4 for r in range(0, rows, 4) for c in range(0, cols, 4)]
    bounds = list(accumulate(lengths, initial=0))
    seg = Segments(torch.tensor(bounds, dtype=torch.int32, device="cuda"), bounds, max(lengths))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(bounds[-1], 16, 80, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
    got = window_attention.attend(q, k, v, seg.cu, seg.max_len, 80**-0.5).float()
    flash = _varlen(q, k, v, seg).float()
    exact = torch.cat([
        torch.nn.functional.scaled_dot_product_attention(
            *(t[s:e].float().transpose(0, 1) for t in (q, k, v)), scale=80**-0.5
        ).transpose(0, 1)
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)
    ])  # fmt: skip
    err = lambda x: float((x - exact).norm() / exact.norm())  # noqa: E731
    assert err(got) < 1e-2 and err(got) <= 1.5 * err(flash) + 1e-3, (err(got), err(flash))
