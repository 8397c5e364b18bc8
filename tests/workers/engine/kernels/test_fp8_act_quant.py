"""The block-FP8 activation quantization kernel (fp8_act_quant.py): fp8_quant's bits, in the layout cuBLAS's
block-scaled GEMM takes. Checked on the CPU through Triton's interpreter on values that divide into e4m3 exactly (the
interpreter rounds to e4m3 otherwise than the GPU), on the GPU (marked) on any values and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.kernels.kernel_check import check_switch_turns_it_off, run_kernel_check
from workers.engine.kernels import fp8_act_quant, fp8_gemm
from workers.engine.kernels.fp8_quant import quantize_token_groups

CHECK = """
import torch
from workers.engine.kernels import fp8_act_quant, fp8_gemm, w8a16_gemm

gen = torch.Generator().manual_seed(0)
# rows: one (a decode), 5, 64 (a 4-padded cuBLAS block); K: one group, 9 groups (a partial second program), 32
for rows, k in ((1, 128), (5, 9 * 128), (64, 4096)):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = w8a16_gemm.exact_rows(rows, k, gen) * torch.exp2(torch.randint(-3, 7, (k // 128,), generator=gen).float()).repeat_interleave(128)
        x[0, -128:] = 0  # a zero group
        x = x.to(dtype)
        q, s = fp8_act_quant.quantize(x)
        want_q, want_s = fp8_gemm.fp8_block_activations(x)
        assert q.dtype == want_q.dtype and s.shape == want_s.shape == (rows, k // 128), (s.shape, want_s.shape)
        assert s.stride() == want_s.stride() == (1, rows), (s.stride(), want_s.stride())
        assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), (rows, k, dtype)
        # a strided x (a column block of a wider tensor) quantizes as its copy does
        wide = torch.cat([x, x], dim=1)[:, k // 2 : k // 2 + k] if k % 256 == 0 else None
        if wide is not None:
            assert torch.equal(fp8_act_quant.quantize(wide)[0].view(torch.uint8), fp8_act_quant.quantize(wide.contiguous())[0].view(torch.uint8))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the GPU tests below run the kernel itself")
def test_kernel_gives_fp8_quant_bits_in_triton_interpreter() -> None:
    run_kernel_check(CHECK, "fp8_act_quant", "bfloat16", timeout=300)


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    check_switch_turns_it_off(monkeypatch, fp8_act_quant)


def test_k_must_be_whole_groups() -> None:
    with pytest.raises(ValueError, match="128-column groups"):
        fp8_act_quant.quantize(torch.zeros(2, 200))


def test_the_cpu_keeps_torch_ops() -> None:
    """Off CUDA the block GEMM's activations come from torch's ops, whatever the switch says."""
    x = torch.randn(4, 256)
    q, s = fp8_gemm.block_activations(x)
    want_q, want_s = quantize_token_groups(x)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_any_values_give_torch_bits_on_cuda_and_in_a_graph() -> None:
    """Gaussian activations over six orders of magnitude (every rounding case of e4m3), bf16, at decode, piecewise
    and prefill row counts: the same bits as torch's ops; and the kernel captured in a CUDA graph replays them."""
    assert fp8_act_quant.probe(torch.device("cuda"), torch.bfloat16), fp8_act_quant.SWITCH.why_off()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, k in ((1, 4096), (37, 12288), (2048, 4096)):
        spread = torch.logspace(-3, 3, k // 128, device="cuda").repeat_interleave(128)
        x = (torch.randn(rows, k, device="cuda", generator=gen) * spread).bfloat16()
        q, s = fp8_act_quant.quantize(x)
        # torch's ops on the CPU: on CUDA torch divides by the Python scalar 448 as a multiplication by its
        # reciprocal (two roundings), so a scale there can be one ulp off the correctly rounded quotient
        want_q, want_s = fp8_gemm.fp8_block_activations(x.cpu())
        # Token-major scales (stride (1, M)); one row's layout is the same memory whatever its strides say.
        assert (rows == 1 or s.stride() == want_s.stride()) and torch.equal(s.cpu(), want_s)
        assert torch.equal(q.view(torch.uint8).cpu(), want_q.view(torch.uint8)), rows
    static = torch.zeros(64, 4096, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s = fp8_act_quant.quantize(static)
    static.copy_(torch.randn(64, 4096, device="cuda", generator=gen).bfloat16())
    graph.replay()
    want_q, want_s = fp8_gemm.fp8_block_activations(static.cpu())
    assert torch.equal(s.cpu(), want_s) and torch.equal(q.view(torch.uint8).cpu(), want_q.view(torch.uint8))
