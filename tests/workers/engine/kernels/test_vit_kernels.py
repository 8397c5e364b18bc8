"""The ViT's Triton rotary and position-embedding kernels (vit_kernels.py): on the CPU through Triton's interpreter
against the eager math, on a GPU against the compiled versions they replace, and a CUDA tower of either Qwen family
warming up with no torch.compile'd site at all."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from PIL import Image

from tests.workers.engine.kernels.kernel_check import check_switch_turns_it_off, run_kernel_check

CHECK = """
import torch
from workers.engine.kernels import fused, vit_kernels
from workers.engine.layers.vision_attention import _rope

gen = torch.Generator().manual_seed(0)
# (patches, heads, head_dim): Qwen3-VL's 16 x 72 (halves of 36, off a power of two), Qwen2.5-VL's 16 x 80, 2B/4B's
# 16 x 64, three heads (not a power of two) and one patch
for n, h, d in ((7, 16, 72), (5, 16, 80), (3, 16, 64), (4, 3, 16), (1, 16, 72)):
    for dtype in (torch.float32, torch.float16):
        # rows of a wider buffer: the projection's output may sit at any row stride
        wide = (3 * torch.randn(n, 3 * h * d + 8, generator=gen)).to(dtype)
        qkv = wide[:, : 3 * h * d].view(n, 3, h, d)
        angles = torch.rand(n, d // 2, generator=gen) * 100
        q, k = vit_kernels.vit_rope(qkv, angles.cos(), angles.sin())
        assert q.shape == k.shape == (n, h, d) and q.dtype == dtype and q.is_contiguous() and k.is_contiguous()
        want = fused.vit_rope(qkv, angles.cos(), angles.sin())  # float32 math rounded once, as the kernel does
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
        for got, ref in zip((q, k), want):
            torch.testing.assert_close(got, ref, **tol)
        if dtype == torch.float32:  # the eager rotary of the CPU path: equal in float32
            eager = _rope(qkv[:, :2], angles.cos()[:, None, None], angles.sin()[:, None, None])
            for got, ref in zip((q, k), eager):
                torch.testing.assert_close(got, ref, **tol)
        assert not torch.allclose(q.float(), qkv[:, 0].float(), atol=1e-2)  # it rotated
        # padded for a kernel that wants head sizes in multiples of 16: the same q and k, v as it is, zeros after
        width = {72: 80, 16: 24}.get(d, d)  # FA4's 80 for 72; no padding at all (v copied alone) for 80 and 64
        padded = vit_kernels.vit_rope_padded(qkv, angles.cos(), angles.sin(), width)
        for got, ref in zip(padded, (q, k, qkv[:, 2]), strict=True):
            assert got.shape == (n, h, width) and got.is_contiguous() and got.dtype == dtype
            assert torch.equal(got[..., :d], ref) and not got[..., d:].any()
try:
    vit_kernels.vit_rope(torch.zeros(2, 2, 3, 8), torch.zeros(2, 4), torch.zeros(2, 4))
    raise AssertionError("took a [n, 2, H, D] input")
except ValueError as exc:
    assert "q|k|v" in str(exc)
q, k = vit_kernels.vit_rope(torch.zeros(0, 3, 2, 8), torch.zeros(0, 4), torch.zeros(0, 4))
assert q.shape == (0, 2, 8)
try:
    vit_kernels.vit_rope_padded(torch.zeros(2, 3, 2, 8), torch.zeros(2, 4), torch.zeros(2, 4), 6)
    raise AssertionError("took heads narrower than head_dim")
except ValueError as exc:
    assert "cannot hold" in str(exc)
# the position embedding: widths below, at and above a column block, a bf16 table as served
for rows, positions, width in ((6, 9, 40), (3, 2304, 512), (5, 2304, 1152), (1, 4, 8)):
    for dtype in (torch.float32, torch.bfloat16):
        table = torch.randn(positions, width, generator=gen).to(dtype)
        taps = torch.randint(0, positions, (rows, 4), generator=gen)
        weights = torch.rand(rows, 4, generator=gen)
        got = vit_kernels.pos_embed(table, taps, weights)
        want = fused.qwen3_vit_pos_embed(table, taps, weights)
        assert got.dtype == want.dtype == torch.float32 and got.shape == (rows, width)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
assert vit_kernels.pos_embed(torch.zeros(4, 8), torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4)).shape == (0, 8)
"""


def test_kernels_match_the_eager_math_under_the_interpreter() -> None:
    run_kernel_check(CHECK, "vit_kernels", "float16")


def test_switch_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine.kernels import vit_kernels

    check_switch_turns_it_off(monkeypatch, vit_kernels)
    assert not vit_kernels.wanted(torch.zeros(2, 3))  # and a CPU tensor never takes them


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU runs the interpreter)")


@cuda
def test_kernels_match_the_compiled_sites_on_cuda() -> None:
    """A 1080p image's patches at Qwen3-VL-8B's ViT shapes, bf16: the same float32 math rounded once as the compiled
    versions, so only last bits where a contraction differs."""
    from workers.engine.kernels import fused, vit_kernels
    
    assert vit_kernels.probe(torch.device("cuda"), torch.bfloat16), vit_kernels.SWITCH.why_off()
    n, h, d, width = 8160, 16, 72, 1152
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(n, 3 * h * d, device="cuda", generator=gen, dtype=torch.bfloat16).view(n, 3, h, d)
    angles = torch.rand(n, d // 2, device="cuda", generator=gen) * 1000
    table = torch.randn(2304, width, device="cuda", generator=gen, dtype=torch.bfloat16)
    taps = torch.randint(0, 2304, (n, 4), device="cuda", generator=gen)
    weights = torch.rand(n, 4, device="cuda", generator=gen)
    pairs = [
        *zip(vit_kernels.vit_rope(qkv, angles.cos(), angles.sin()),
             fused.compiled(fused.vit_rope)(qkv, angles.cos(), angles.sin()), strict=True),
        (vit_kernels.pos_embed(table, taps, weights), fused.compiled(fused.qwen3_vit_pos_embed)(table, taps, weights)),
    ]  # fmt: skip
    q, k = pairs[0][0], pairs[1][0]
    padded = vit_kernels.vit_rope_padded(qkv, angles.cos(), angles.sin(), 80)  # FA4's heads: the same values, zeros
    for got, ref in zip(padded, (q, k, qkv[:, 2]), strict=True):
        assert got.shape == (n, h, 80) and torch.equal(got[..., :d], ref) and not got[..., d:].any()
    for got, want in pairs:
        assert got.dtype == want.dtype and got.shape == want.shape
        diff = (got.float() - want.float()).abs()
        if got.dtype == torch.float32:  # the position embedding's sums: float32 rounding of another summation order
            assert float(diff.max()) <= 1e-6 * float(want.abs().max())
        else:
            assert float((diff > 0).float().mean()) < 1e-2 and float(diff.max()) <= 2**-6 * float(want.abs().max())


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fixture", ["demo_model_dir", "qwen3_model_dir", "qwen3_moe_model_dir", "qwen3_5_model_dir"])
def test_a_qwen_model_serves_images_without_torch_compile(
    fixture: str, request: pytest.FixtureRequest, make_image: Callable[..., Image.Image]
) -> None:
    """Qwen2.5-VL's, Qwen3-VL's (dense and MoE) and Qwen3.5's CUDA engines run no torch.compile'd site, neither in
    the fused warm-up (which runs every site) nor serving an image: the ViT's rotary and position embedding
    (vit_kernels.py) and Qwen3.5's gated attention and Gated DeltaNet passes (hybrid_kernels.py) were the last."""
    from ipc.prompts import SamplingParams
    from workers.engine.config import EngineConfig
    from workers.engine.kernels import fused
    from workers.engine.layers.vision_attention import VisionAttention
    from workers.engine.offline import Engine

    fused._compiled.clear()
    engine = Engine(EngineConfig(model=str(request.getfixturevalue(fixture)), device="cuda", dtype="bfloat16"))
    vision = engine.runner.vision
    # the fused path is on (every tower's attention has the flag), so the warm-up ran every site
    assert vision is not None and all(m.fused for m in vision.modules() if isinstance(m, VisionAttention))
    chat = [{"role": "user", "content": [{"type": "image", "image": make_image(160, 120)},
                                         {"type": "text", "text": "Describe it."}]}]
    out = engine.generate([chat], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and engine.runner.counters.images_encoded == 1
    assert not fused._compiled, sorted(fused._compiled)
