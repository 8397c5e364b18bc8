"""The weight-only FP8 GEMM (w8a16_gemm.py) and how fp8_gemm.py routes to it.

Triton's interpreter loads float8_e4m3fn and widens it correctly, so the kernel itself runs on the CPU; but its
tl.dot mishandles bfloat16 inputs (test_skinny_gemm.py), so the interpreter checks run float32 and float16
activations and the bf16 path is checked on a GPU (marked) against the dequantized bf16 GEMM.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.workers.engine.kernels.kernel_check import run_kernel_check
from workers.engine.kernels import fp8_gemm, w8a16_gemm
from workers.engine.kernels.fp8_quant import BLOCK, quantize_block, quantize_rows

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)

CHECK = """
import torch
from workers.engine.kernels import w8a16_gemm as g
from workers.engine.kernels.fp8_quant import BLOCK, quantize_block, quantize_rows, quantize_token_groups
from workers.engine.kernels.w8a16_gemm import Tile

gen = torch.Generator().manual_seed(0)


def layouts(w):
    qb, sb = quantize_block(w)
    qr, sr = quantize_rows(w)
    return {"block": (qb, sb), "row-block": (qb, sb.repeat_interleave(BLOCK, 0)[: w.shape[0]]), "channel": (qr, sr)}


# (rows, N, K, bias, tile): N and K ending inside a tile and inside a 128-block; no split, splits of 2 and 3 (the
# partial + sum pass; 3 leaves an empty last split); 16-row and 64-row M blocks, and 40 rows over one 64-row block.
CASES = [
    (1, 200, 384, True, Tile(32, 128, 1, 4, 2)),
    (3, 130, 700, False, Tile(64, 64, 2, 4, 2)),
    (16, 96, 1000, True, Tile(32, 128, 3, 4, 2)),
    (40, 70, 260, True, Tile(16, 64, 1, 4, 2)),
    (1, 48, 520, False, Tile(16, 256, 2, 4, 2)),  # BLOCK_K 256 runs as 128 where scales vary along K
    (2, 64, 640, True, None),  # the kernel's own tile choice (FP8_ACTIVATIONS: x on its e4m3 grid)
    (70, 48, 384, True, None),  # and above 64 rows: two M blocks, no K split
]
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
    for rows, n, k, bias, tile in CASES:
        mode = (tile or g.tile(n, k, 132, rows)).mode
        x = (g.exact_rows(rows, k, gen) if mode == g.FP8_ACTIVATIONS else torch.randn(rows, k, generator=gen)).to(dtype)
        w = g.spread_weight(n, k, gen)
        b = torch.randn(n, generator=gen).to(dtype) if bias else None
        for name, (q, s) in layouts(w).items():
            want = g.reference(x, q, s, b, mode)
            got = g.linear(x, q, s, b, use=tile)
            assert got.shape == (rows, n) and got.dtype == dtype, (got.shape, got.dtype)
            err = float((got.float() - want).abs().max() / want.abs().max())
            assert err <= tol, (dtype, rows, n, k, name, err)
            # The check can tell a scale read from the neighbouring K block (or row, for channel scales): that
            # product is off by far more than the tolerance.
            wrong = g.reference(x, q, s.roll(1, dims=0 if name == "channel" else 1), b, mode)
            assert float((wrong - want).abs().max() / want.abs().max()) > 20 * tol, (name, rows, n, k)

# FMA (CUDA cores, 1-4 rows a program) equals the same reference; FP8_ACTIVATIONS quantizes each row per 128
# columns: on x already on that e4m3 grid (exact_rows; the GPU test takes any x) it equals the reference of the
# same quantization.
for rows, n, k, bias, split in ((1, 200, 384, True, 1), (3, 130, 700, False, 2), (6, 96, 1000, True, 3)):
    w = g.spread_weight(n, k, gen)
    b = torch.randn(n, generator=gen) if bias else None
    for name, (q, s) in layouts(w).items():
        x = torch.randn(rows, k, generator=gen)
        want = g.reference(x, q, s, b)
        got = g.linear(x, q, s, b, use=Tile(32, 128, split, 4, 2, g.FMA))
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5, ("fma", rows, n, k, name)
        x = g.exact_rows(rows, k, gen)
        want = g.reference(x, q, s, b, g.FP8_ACTIVATIONS)
        got = g.linear(x, q, s, b, use=Tile(32, 128, split, 4, 2, g.FP8_ACTIVATIONS))
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5, ("fp8 x", rows, n, k, name)
        # on a 64-column grid the kernel's 128-column groups do round, off the unquantized product (how far is the
        # GPU test's: the interpreter's float32 -> e4m3 cast is not the GPU's round-to-nearest-even)
        q64, s64 = quantize_token_groups(x.reshape(rows, -1)[:, : k // 64 * 64], 64)
        x = torch.cat([(q64.float() * s64.repeat_interleave(64, 1)), x[:, k // 64 * 64 :]], dim=1)
        got = g.linear(x, q, s, b, use=Tile(32, 128, split, 4, 2, g.FP8_ACTIVATIONS))
        assert float((got - g.reference(x, q, s, b)).abs().max()) > 1e-3 * float(want.abs().max()), (rows, n, k, name)

# Leading dimensions are kept, x's dtype comes out, split partials add up in a fixed order (same bits twice), and
# no rows is no launch.
q, s = quantize_block(g.spread_weight(40, 256, gen))
x = torch.randn(2, 3, 256, generator=gen)
once = g.linear(x, q, s, use=Tile(32, 64, 2, 4, 2))
assert once.shape == (2, 3, 40) and torch.equal(once, g.linear(x, q, s, use=Tile(32, 64, 2, 4, 2)))
assert g.linear(torch.zeros(0, 256), q, s).shape == (0, 40)
"""


def test_kernel_matches_the_dequantized_product_under_the_interpreter() -> None:
    run_kernel_check(CHECK, "w8a16_gemm", "float16")


def test_tiles_fill_the_card_and_forced_tiles_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(w8a16_gemm.TILE_ENV, raising=False)
    for n, k in ((4096, 4096), (6144, 4096), (4096, 12288), (2048, 768)):
        t = w8a16_gemm.tile(n, k, 132)
        programs = -(-n // t.block_n) * t.split_k
        assert k % (t.split_k * t.block_k) == 0, (n, k, t)
        # PROGRAMS_PER_SM, unless another halving would leave a split under MIN_SPLIT_K columns
        want = int(w8a16_gemm.PROGRAMS_PER_SM * 132)
        assert programs >= want or k // (2 * t.split_k) < w8a16_gemm.MIN_SPLIT_K, (n, k, t)
    # the splits the H200 sweep chose for a 8B's qkv, gate_up and down
    assert [w8a16_gemm.tile(n, k, 132).split_k for n, k in ((6144, 4096), (24576, 4096), (4096, 12288))] == [8, 2, 8]
    monkeypatch.setenv(w8a16_gemm.TILE_ENV, "64,128,8,4,3")
    assert w8a16_gemm.tile(4096, 4096, 132) == w8a16_gemm.Tile(64, 128, 8, 4, 3)
    tiles = w8a16_gemm.candidates(4096, (w8a16_gemm.DOT, w8a16_gemm.FMA))
    assert len(tiles) == len(set(tiles)) and all(BLOCK % t.block_k == 0 for t in tiles)
    assert {t.mode for t in tiles} == {w8a16_gemm.DOT, w8a16_gemm.FMA}
    monkeypatch.setenv(w8a16_gemm.TILE_ENV, "32,128,1,4,4,2")  # a sixth number picks the mode
    assert w8a16_gemm.tile(4096, 4096, 132).mode == w8a16_gemm.FMA
    monkeypatch.delenv(w8a16_gemm.TILE_ENV)
    monkeypatch.setattr(w8a16_gemm, "FMA_MAX_ROWS", 2)
    assert [w8a16_gemm.tile(4096, 4096, 132, rows).mode for rows in (1, 2, 3)] == [w8a16_gemm.FMA] * 2 + [w8a16_gemm.DEFAULT.mode]


def test_auto_takes_w8a16_at_decode_rows_and_w8a16_takes_it_everywhere() -> None:
    rows = fp8_gemm.W8A16_MAX_ROWS
    assert fp8_gemm.wants_w8a16("auto", 1) and fp8_gemm.wants_w8a16("auto", rows)
    assert not fp8_gemm.wants_w8a16("auto", rows + 1)
    assert fp8_gemm.wants_w8a16("w8a16", 8192)
    assert not fp8_gemm.wants_w8a16("dequant", 1) and not fp8_gemm.wants_w8a16("bf16", 1)


def test_cpu_tensors_keep_the_dequantized_gemm_under_every_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 256)
    q, s = quantize_block(torch.randn(64, 256))
    for v in fp8_gemm.VARIANTS:
        monkeypatch.setenv(fp8_gemm.VARIANT_ENV, v)
        assert fp8_gemm.kernel_for(x, q, s) is None
        torch.testing.assert_close(fp8_gemm.linear(x, q, s), fp8_gemm.dequant_linear(x, q, s))


def test_a_kernel_that_raises_is_refused_once_for_that_weight(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Routing with the kernel's availability forced on (the CPU cannot run it outside the interpreter): a weight
    whose launch raises warns once and takes the dequantized GEMM from then on."""
    monkeypatch.setenv(fp8_gemm.VARIANT_ENV, "auto")
    monkeypatch.setattr(fp8_gemm, "_refused", set())
    usable = lambda x, w, s: ("w8a16", tuple(w.shape), tuple(s.shape)) not in fp8_gemm._refused  # noqa: E731
    monkeypatch.setattr(fp8_gemm, "w8a16_usable", usable)
    calls: list[int] = []

    def broken(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(w8a16_gemm, "unsummed", broken)
    x = torch.randn(2, 256)
    q, s = quantize_rows(torch.randn(64, 256))
    assert fp8_gemm.kernel_for(x, q, s) == "w8a16"
    assert fp8_gemm.kernel_for(torch.randn(fp8_gemm.W8A16_MAX_ROWS + 1, 256), q, s) is None  # native: none on CPU
    for _ in range(2):
        torch.testing.assert_close(fp8_gemm.linear(x, q, s), fp8_gemm.dequant_linear(x, q, s))
    assert calls == [2] and caplog.text.count("FP8 w8a16 GEMM refused weight (64, 256)") == 1


def test_a_failed_probe_turns_w8a16_off_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fp8_gemm, "_probed", {})
    monkeypatch.setattr(w8a16_gemm, "probe", lambda device, dtype: False)
    assert not fp8_gemm.probe("w8a16", torch.device("cpu"))
    assert not fp8_gemm.probe("w8a16", torch.device("cpu"))
    assert caplog.text.count("FP8 w8a16 GEMM unusable on cpu") == 1


def test_the_kernel_refuses_a_weight_that_is_not_fp8() -> None:
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w8a16_gemm.linear(torch.randn(1, 128), torch.randn(64, 128), torch.ones(64, 1))


def cuda_layouts(n: int, k: int, m: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x, FP8 weight, scales, bias) on CUDA for one spread weight [n, k] in each scale layout (128 x 128 blocks,
    those blocks repeated per row, row blocks), x of ``m`` bf16 rows."""
    gen = torch.Generator().manual_seed(m)
    w = w8a16_gemm.spread_weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    qb, sb = quantize_block(w)
    qr, sr = quantize_rows(w)
    for q, s in ((qb, sb), (qb, sb.repeat_interleave(BLOCK, 0)[:n]), (qr, sr)):
        yield x, q.cuda(), s.cuda(), b


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA device with FP8 (SM89+)")
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_w8a16_matches_the_dequantized_bf16_gemm_on_gpu(m: int) -> None:
    """bf16 activations (the interpreter cannot check them): within bf16 output rounding of the dequantized bf16
    GEMM (both read the same FP8 values; only the float32 sums' order and the weight's bf16 rounding differ)."""
    assert w8a16_gemm.probe(torch.device("cuda"), torch.bfloat16), w8a16_gemm.SWITCH.why_off()
    for n, k in ((4096, 4096), (1000, 1416)):  # a 8B's o projection; partial tiles in N and K
        for x, q, s, b in cuda_layouts(n, k, m):
            ref = w8a16_gemm.reference(x, q, s, b)
            default = w8a16_gemm.reference(x, q, s, b, w8a16_gemm.DEFAULT.mode)
            for got, want in ((w8a16_gemm.linear(x, q, s, b), default), (fp8_gemm.dequant_linear(x, q, s, b), ref)):
                assert got.dtype == torch.bfloat16
                err = (got.float() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
                assert err <= 0.01, (n, k, tuple(s.shape), float(err))
            # every mode, on any x: FP8_ACTIVATIONS against the reference that quantizes x the same way (a tie in
            # e4m3 rounding or an ulp of a group's scale moves a product by one e4m3 step at most)
            for mode in (w8a16_gemm.DOT, w8a16_gemm.FMA, w8a16_gemm.FP8_ACTIVATIONS):
                got = w8a16_gemm.linear(x, q, s, b, use=w8a16_gemm.Tile(32, 128, 2, 4, 4, mode)).float()
                want = w8a16_gemm.reference(x, q, s, b, mode)
                err = (got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
                assert err <= 0.01, (mode, n, k, tuple(s.shape), float(err))


def test_tma_only_for_cuda_weights_with_aligned_rows_and_the_switch_on(monkeypatch: pytest.MonkeyPatch) -> None:
    q, _ = quantize_block(torch.randn(64, 256))
    assert not w8a16_gemm.tma_serves(q)  # the CPU (and the interpreter's tests) keep the per-thread loads
    assert w8a16_gemm.tile(4096, 4096, 132, tma=True).stages == w8a16_gemm.TMA_STAGES
    assert w8a16_gemm.tile(4096, 4096, 132).stages == w8a16_gemm.DEFAULT.stages
    if CUDA_FP8 and torch.cuda.get_device_capability()[0] >= 9:
        assert w8a16_gemm.tma_serves(q.cuda())
        assert not w8a16_gemm.tma_serves(quantize_block(torch.randn(64, 264))[0].cuda())  # 264-byte rows
        monkeypatch.setenv(w8a16_gemm.TMA_ENV, "0")
        assert not w8a16_gemm.tma_serves(q.cuda())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8 or torch.cuda.get_device_capability()[0] < 9, reason="needs a CUDA device with TMA (SM90+)")
@pytest.mark.parametrize("m", [1, 16])
def test_tma_and_per_thread_loads_both_match_the_reference(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight's tiles through TMA (zeros past its rows and columns: partial tiles in N and K) and through
    per-thread loads, at the same tiles, each within the tolerance of the test above of the reference that
    quantizes x as its mode does (the dot's order of sums may differ between the two, so their last bits may)."""
    for n, k in ((4096, 4096), (1000, 1408)):
        for x, q, s, b in cuda_layouts(n, k, m):
            monkeypatch.setenv(w8a16_gemm.TMA_ENV, "1")  # the last layout's loop below ended with it off
            assert w8a16_gemm.tma_serves(q)
            for t in (w8a16_gemm.Tile(128, 128, 4, 4, 3, w8a16_gemm.FP8_ACTIVATIONS),
                      w8a16_gemm.Tile(32, 128, 2, 4, 4, w8a16_gemm.DOT), w8a16_gemm.Tile(32, 128, 2, 4, 4, w8a16_gemm.FMA)):
                want = w8a16_gemm.reference(x, q, s, b, t.mode)
                for tma in ("1", "0"):
                    monkeypatch.setenv(w8a16_gemm.TMA_ENV, tma)
                    got = w8a16_gemm.linear(x, q, s, b, use=t).float()
                    err = (got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
                    assert err <= 0.01, (tma, n, k, tuple(s.shape), t, float(err))
