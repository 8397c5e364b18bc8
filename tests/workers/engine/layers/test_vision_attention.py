"""The vision tower's attention with a packed kernel that takes only head sizes in multiples of 16 (FA4 on Qwen3-VL's
and Qwen3.5's 72): the heads go to it zero-padded, its padded output goes straight into the projection, whose weight
the first such call re-lays with zero columns, and every path of the layer keeps the default kernels' answer (a
refusal after the padding too, on CUDA)."""

from __future__ import annotations

import copy
from itertools import accumulate
from typing import Any

import pytest
import torch
from torch import Tensor

from workers.engine.kernels import vit_kernels
from workers.engine.layers.vision_attention import Segments, VisionAttention

HEADS, HEAD_DIM = 2, 72


def only_multiples_of_16(widths: list[int]) -> Any:
    """A stand-in for the packed call: refuses a head size off a multiple of 16 as FA4 does, else attends each segment
    with SDPA at the given scale; records the head sizes it was called with."""

    def call(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, top: int, scale: float) -> Tensor:
        widths.append(q.shape[-1])
        if q.shape[-1] % 16:
            raise AssertionError("head size must be a multiple of 16")
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1  # rows at any stride, as FA4 reads them
        b = cu.tolist()
        return torch.cat([
            torch.nn.functional.scaled_dot_product_attention(
                *(t[s:e].transpose(0, 1) for t in (q, k, v)), scale=scale
            ).transpose(0, 1)
            for s, e in zip(b[:-1], b[1:], strict=True)
        ])  # fmt: skip

    return call


def frames(*lengths: int) -> Segments:
    bounds = list(accumulate(lengths, initial=0))
    return Segments(torch.tensor(bounds, dtype=torch.int32), bounds, max(lengths), frames=True)


def cuda_block(lengths: list[int]) -> tuple[VisionAttention, VisionAttention, Segments, Tensor, Tensor, Tensor]:
    """A Qwen3-VL / Qwen3.5 tower block's attention (16 heads of 72, bf16, fused kernels on) and a copy of it, frames of
    ``lengths`` patches, an input and the rotary's cos and sin: (reference, layer, seg, x, cos, sin)."""
    torch.manual_seed(0)
    reference = VisionAttention(1152, 16).cuda().bfloat16()
    reference.fused = True
    bounds = list(accumulate(lengths, initial=0))
    seg = Segments(torch.tensor(bounds, dtype=torch.int32, device="cuda"), bounds, max(lengths), frames=True)
    x = torch.randn(bounds[-1], 1152, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(bounds[-1], 36, device="cuda") * 6
    return reference, copy.deepcopy(reference), seg, x, angles.cos(), angles.sin()


def test_padded_heads_reach_the_projection_as_they_come_and_every_path_agrees() -> None:
    torch.manual_seed(0)
    reference = VisionAttention(HEADS * HEAD_DIM, HEADS)
    layer = copy.deepcopy(reference)
    widths: list[int] = []
    layer.packed = only_multiples_of_16(widths)
    seg = frames(9, 11)
    x = torch.randn(20, HEADS * HEAD_DIM)
    angles = torch.rand(20, HEAD_DIM // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    with torch.inference_mode():
        want = reference(x, seg, cos, sin, flash=False)  # the CPU's grouped SDPA
        first = layer(x, seg, cos, sin, flash=True)
        assert widths == [72, 80] and layer.packed_pad == 8 and layer.proj_pad == 8
        weight = layer.proj.weight.view(HEADS * HEAD_DIM, HEADS, 80)
        assert layer.proj.in_features == HEADS * 80 and not weight[..., 72:].any()
        assert torch.equal(weight[..., :72].reshape(reference.proj.weight.shape), reference.proj.weight)
        again = layer(x, seg, cos, sin, flash=True)  # padded from the start now: one call
        assert widths == [72, 80, 80]
        default = layer(x, seg, cos, sin, flash=False)  # a default kernel's [n, H, 72] meets the padded projection
    for out in (first, again, default):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_heads_the_kernel_takes_as_they_are_change_nothing() -> None:
    layer = VisionAttention(2 * 64, 2)
    widths: list[int] = []
    layer.packed = only_multiples_of_16(widths)
    weight = layer.proj.weight
    with torch.inference_mode():
        layer(torch.randn(6, 128), frames(6), torch.ones(6, 32), torch.zeros(6, 32), flash=True)
    assert widths == [64] and layer.packed_pad == layer.proj_pad == 0 and layer.proj.weight is weight


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton rotary)")
def test_on_cuda_the_padded_rotary_feeds_a_kernel_that_wants_multiples_of_16() -> None:
    """The CUDA path without FA4: a stand-in packed call that refuses 72 (SDPA after it), so the layer's first call
    pads by copies and re-lays the projection, and the next ones take q, k and v padded from the Triton rotary; bf16,
    a Qwen3-VL block's 16 heads of 72, against the default kernels on the same weights."""
    reference, layer, seg, x, cos, sin = cuda_block([2356, 1380])
    widths: list[int] = []
    layer.packed = only_multiples_of_16(widths)
    with torch.inference_mode():
        want = reference(x, seg, cos, sin, flash=True)
        outs = [layer(x, seg, cos, sin, flash=True) for _ in range(3)]
    assert widths == [72, 80, 80, 80] and layer.proj_pad == 8
    for out in outs:
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FA4 and the Triton rotary)")
def test_on_fa4_the_rotary_writes_the_padded_heads_and_the_answer_is_the_default_kernels() -> None:
    """A Qwen3-VL / Qwen3.5 tower block's attention (16 heads of 72) on two 1080p-sized frames, bf16: FA4 with the
    padded rotary and projection against the default kernels (FA2 varlen or cuDNN) on the same weights."""
    from workers.engine.kernels import backends

    packed = backends.vision_kernel("fa4", "cuda")
    if packed is None:
        pytest.skip("flash-attn-4 is not installed")
    reference, layer, seg, x, cos, sin = cuda_block([8160, 4096])
    layer.packed = packed
    calls: list[int] = []
    padded_rope = vit_kernels.vit_rope_padded

    def spy(*args: Any) -> Any:
        calls.append(1)
        return padded_rope(*args)

    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(vit_kernels, "vit_rope_padded", spy)
        want = reference(x, seg, cos, sin, flash=True)
        outs = [layer(x, seg, cos, sin, flash=True) for _ in range(2)]
    assert layer.packed is not None and layer.packed_pad == layer.proj_pad == 8 and calls == [1]

    def refusing(*args: Any) -> Tensor:
        raise RuntimeError("no kernel for this call")

    layer.packed = refusing  # a refusal after the padding: the padded heads go to the default kernels as they are
    with torch.inference_mode():
        outs.append(layer(x, seg, cos, sin, flash=True))
    assert layer.packed is None
    for out in outs:
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
