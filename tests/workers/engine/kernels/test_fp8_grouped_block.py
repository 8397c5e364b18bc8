"""The block-FP8 grouped GEMM of routed experts at prefill rows (fp8_grouped_block.py): checked on the CPU through
Triton's interpreter against the same math in eager torch, on activations that quantize to e4m3 without rounding
(the interpreter rounds otherwise than the GPU); on the GPU (marked) at Qwen3-VL-30B-A3B's expert shape, in bf16,
against the reference, and replayed from a CUDA graph with other group sizes."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.kernels.kernel_check import check_switch_turns_it_off, run_kernel_check
from workers.engine.kernels import fp8_grouped_block
from workers.engine.kernels.fp8_quant import is_block, quantize_block, quantize_rows

CHECK = """
import torch
from workers.engine.kernels import fp8_grouped_block as g, w8a16_gemm
from workers.engine.kernels.fp8_quant import quantize_block, quantize_rows

gen = torch.Generator().manual_seed(0)


def ragged(*shape):  # 128 x 128 tiles 2^0 to 2^4 apart: a scale read from another tile shows
    w = torch.randn(*shape, generator=gen)
    tiles = torch.randint(0, 5, (shape[0], -(-shape[1] // 128), -(-shape[2] // 128)), generator=gen).float()
    return w * torch.exp2(tiles).repeat_interleave(128, 1).repeat_interleave(128, 2)[:, : shape[1], : shape[2]]


# Groups: empty experts first, last and between; one spanning several row tiles; one ending mid-tile; N ending
# mid-block; K of one and of three 128-column groups; scales as tiles and per row (a shard's partial tiles).
for sizes, n, k, per_row in (([0, 70, 1, 0, 9, 0], 200, 384, False), ([130], 128, 128, False),
                             ([5, 0, 64], 96, 256, True), ([3, 40], 130, 200, False)):  # K = 200: a partial group
    e = len(sizes)
    x = w8a16_gemm.exact_rows(sum(sizes), -(-k // 128) * 128, gen)[:, :k] * torch.exp2(torch.randint(-2, 3, (sum(sizes), 1), generator=gen).float())
    if per_row:  # a scale per row and 128 columns, rows 2^0 to 2^3 apart
        w = ragged(e, n, k) * torch.exp2(torch.randint(0, 4, (e, n, 1), generator=gen).float())
        q, s = quantize_rows(w.reshape(e, n, k // 128, 128))
        q, s = q.reshape(e, n, k), s.squeeze(-1)
    else:
        q, s = quantize_block(ragged(e, n, k))
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        got = g.grouped_mm(x.to(dtype), q, s, ends)
        assert got.dtype == dtype and got.shape == (sum(sizes), n)
        want = g.reference(x.to(dtype), q, s, ends)
        # float32: the same products summed in another order (per 128-column step, then scaled); bf16: one rounding
        # (the interpreter may truncate)
        torch.testing.assert_close(got.float(), want, rtol=1e-5 if dtype == torch.float32 else 2**-7,
                                   atol=1e-5 * float(want.abs().max()))
    if s.shape[2] > 1:  # scales of another 128-column group would be far off
        wrong = g.reference(x, q, s.roll(1, 2), ends)
        assert (wrong - want).abs().max() > 0.1 * want.abs().max()
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the GPU test below runs the kernel itself")
def test_kernel_matches_the_dequantized_experts_in_triton_interpreter() -> None:
    run_kernel_check(CHECK, "fp8_grouped_block", "float32", timeout=300)


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    check_switch_turns_it_off(monkeypatch, fp8_grouped_block)


def test_scale_layouts_are_told_apart() -> None:
    """Tiles and per-row block scales are blocks; one scale per row (the channel recipe's) is not."""
    w = torch.zeros(2, 256, 384)
    assert is_block(w, quantize_block(w)[1]) and is_block(w, torch.ones(2, 256, 3))
    assert not is_block(w, quantize_rows(w)[1])
    partial = torch.zeros(2, 256, 200)  # K = 200: a partial last group (zero-padded activations)
    assert is_block(partial, torch.ones(2, 2, 2)) and not is_block(partial, torch.ones(2, 256, 1))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs CUDA with FP8"
)
def test_experts_shape_in_bf16_and_replayed_from_a_cuda_graph() -> None:
    assert fp8_grouped_block.probe(torch.device("cuda"), torch.bfloat16), fp8_grouped_block.SWITCH.why_off()
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, inter, pairs = 128, 2048, 768, 2048 * 8  # a 2,048-token chunk, top 8
    q, s = quantize_block(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen))

    def groups() -> torch.Tensor:
        ids = torch.randint(0, experts, (pairs,), device="cuda", generator=gen).sort().values
        return torch.searchsorted(ids, torch.arange(experts, device="cuda"), right=True).to(torch.int32)

    x = torch.randn(pairs, hidden, device="cuda", generator=gen).bfloat16()
    ends = groups()
    got = fp8_grouped_block.grouped_mm(x, q, s, ends).float()
    want = fp8_grouped_block.reference(x.float(), q, s, ends)
    assert (got - want).pow(2).mean().sqrt() <= 0.01 * want.pow(2).mean().sqrt()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fp8_grouped_block.grouped_mm(x, q, s, ends)
    x.copy_(torch.randn(pairs, hidden, device="cuda", generator=gen).bfloat16())
    ends.copy_(groups())
    graph.replay()
    torch.testing.assert_close(replayed, fp8_grouped_block.grouped_mm(x, q, s, ends), rtol=0, atol=0)
