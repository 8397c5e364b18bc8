"""A block-FP8 checkpoint's routed experts become FP8 stacks with the checkpoint's own values and 128 x 128 tiles
(models/fp8_layers.py), whether the checkpoint stores one tensor per expert (Qwen's ``-FP8`` repos) or fused
[E, out, in] / [E, in, out] tensors (transformers' layouts), at TP 1 and on each rank of TP 2. Conversion runs per
rank with no communication, so it is checked on the CPU with the grouped kernel's availability granted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from workers.engine.kernels import fp8_gemm
from workers.engine.kernels.fp8_quant import FP8, dequantize, quantize_block
from workers.engine.layers.linear import TPGroup, get_weight_loader
from workers.engine.models.fp8_layers import convert_to_fp8
from workers.engine.models.qwen3_vl.moe import StackedExperts

EXPERTS, HIDDEN = 3, 256


def _ragged(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Weights whose 128 x 128 tiles are 2^0 to 2^4 apart: a scale taken from another tile re-quantizes inexactly."""
    w = torch.randn(*shape, generator=gen)
    tiles = torch.randint(0, 5, (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128)), generator=gen).float()
    return w * torch.exp2(tiles).repeat_interleave(128, -2).repeat_interleave(128, -1)[..., : shape[-2], : shape[-1]]


def _load(experts: StackedExperts, layout: str, inter: int) -> dict[str, Any]:
    """Fill ``experts`` from a block checkpoint in ``layout`` (dequantized, as the loader does); the record of each
    FP8 tensor's scales and stored shape, and the routes from checkpoint names to (parameter, shard id)."""
    gen = torch.Generator().manual_seed(inter)
    record: dict[str, tuple[torch.Tensor, torch.Size]] = {}
    routes: dict[str, tuple[str, object]] = {}

    def put(name: str, param: str, shard: object, stored: torch.Tensor) -> None:
        q, s = quantize_block(stored)
        target = getattr(experts, param)
        get_weight_loader(target)(target, dequantize(q, s), shard)
        record["lm." + name], routes[name] = (s, q.shape), (f"experts.{param}", shard)

    if layout == "per-expert":
        for e in range(EXPERTS):
            put(f"e{e}.gate", "gate_up_proj", ("gate", e), _ragged(gen, inter, HIDDEN))
            put(f"e{e}.up", "gate_up_proj", ("up", e), _ragged(gen, inter, HIDDEN))
            put(f"e{e}.down", "down_proj", e, _ragged(gen, HIDDEN, inter))
    else:  # fused, "linear" [E, out, in] or "hub" [E, in, out] (tiles over the stored layout)
        hub = layout == "hub"
        gate_up = _ragged(gen, EXPERTS, *((HIDDEN, 2 * inter) if hub else (2 * inter, HIDDEN)))
        down = _ragged(gen, EXPERTS, *((inter, HIDDEN) if hub else (HIDDEN, inter)))
        put("gate_up", "gate_up_proj", None, gate_up)
        put("down", "down_proj", None, down)
    return {"record": record, "routes": routes}


@pytest.mark.parametrize("layout", ["per-expert", "linear", "hub"])
@pytest.mark.parametrize(
    ("inter", "tp_size", "rank", "gate_up_scale", "down_scale"),
    [
        (256, 1, 0, (EXPERTS, 4, 2), (EXPERTS, 2, 2)),  # whole tiles: 128 x 128 scales
        (256, 2, 1, (EXPERTS, 2, 2), (EXPERTS, 2, 1)),  # rank 1's 128 intermediate rows and down's 2nd column block
        (96, 1, 0, (EXPERTS, 192, 2), (EXPERTS, 2, 1)),  # gate/up halves of 96 rows: a scale per row and 128 columns
        (96, 2, 0, None, None),  # down's 48-column shards would split a 128-column block: stays in the model dtype
    ],
)
def test_block_expert_stacks_hold_the_checkpoints_values(
    layout: str, inter: int, tp_size: int, rank: int, gate_up_scale: tuple[int, ...] | None,
    down_scale: tuple[int, ...] | None, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(fp8_gemm, "grouped_usable", lambda *_: True)
    experts = StackedExperts(EXPERTS, HIDDEN, inter, TPGroup(rank=rank, size=tp_size))
    loaded = _load(experts, layout, inter)
    lm = torch.nn.ModuleDict({"experts": experts})
    routes = loaded["routes"]
    lm.route = lambda name: routes[name]  # type: ignore[assignment]
    plain = experts.gate_up_proj.clone(), experts.down_proj.clone()
    converted = convert_to_fp8(lm, loaded["record"], 128)
    if gate_up_scale is None:
        assert converted == 0 and experts.gate_up_proj.dtype == torch.float32 and experts.fp8_scales() is None
        return
    assert converted == 1 and experts.gate_up_proj.dtype == FP8 and experts.down_proj.dtype == FP8
    scales = experts.fp8_scales()
    assert scales is not None and scales[0].shape == gate_up_scale and scales[1].shape == down_scale
    # Exactly the values the loader dequantized: the checkpoint's own FP8 values and scales came back.
    assert torch.equal(dequantize(experts.gate_up_proj, scales[0]), plain[0])
    assert torch.equal(dequantize(experts.down_proj, scales[1]), plain[1])


@pytest.mark.parametrize(("mode", "dtype", "scale_shape"), [("rowwise", FP8, (EXPERTS, 512, 1)), ("bf16", torch.float32, None)])
def test_the_environment_can_requantize_or_keep_them(
    mode: str, dtype: torch.dtype, scale_shape: tuple[int, ...] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fp8_gemm, "grouped_usable", lambda *_: True)
    monkeypatch.setenv(fp8_gemm.BLOCK_EXPERTS_ENV, mode)
    experts = StackedExperts(EXPERTS, HIDDEN, 256, TPGroup())
    loaded = _load(experts, "per-expert", 256)
    lm = torch.nn.ModuleDict({"experts": experts})
    lm.route = lambda name: loaded["routes"][name]  # type: ignore[assignment]
    assert convert_to_fp8(lm, loaded["record"], 128) == (scale_shape is not None)
    assert experts.gate_up_proj.dtype == dtype
    assert (experts.gate_up_scale.shape if experts.gate_up_scale is not None else None) == scale_shape


def test_an_unknown_mode_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fp8_gemm.BLOCK_EXPERTS_ENV, "tiles")
    with pytest.raises(ValueError, match="GLIMPSE_FP8_BLOCK_EXPERTS='tiles'"):
        fp8_gemm.block_experts()


def test_modules_named_in_the_keep_list_stay_in_the_model_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLIMPSE_FP8_KEEP_DTYPE: the attention projections of a MoE model kept dequantized, the experts FP8."""
    from workers.engine.layers.linear import ColumnParallelLinear
    from workers.engine.models.fp8_layers import KEEP_ENV

    monkeypatch.setattr(fp8_gemm, "grouped_usable", lambda *_: True)
    monkeypatch.setenv(KEEP_ENV, "self_attn,unused")
    experts = StackedExperts(EXPERTS, HIDDEN, 256, TPGroup())
    loaded = _load(experts, "per-expert", 256)
    qkv = ColumnParallelLinear(HIDDEN, 512, bias=False)
    q, s = quantize_block(torch.randn(512, HIDDEN))
    qkv.weight_loader(qkv.weight, dequantize(q, s))
    lm = torch.nn.ModuleDict({"experts": experts, "self_attn": qkv})
    routes = {**loaded["routes"], "qkv": ("self_attn.weight", None)}
    lm.route = lambda name: routes[name]  # type: ignore[assignment]
    assert convert_to_fp8(lm, {**loaded["record"], "lm.qkv": (s, q.shape)}, 128) == 1
    assert experts.gate_up_proj.dtype == FP8 and qkv.weight.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)), reason="needs Hopper")
@pytest.mark.parametrize("rows", [4, 300])
def test_fp8_expert_blocks_match_their_dequantized_copies_on_gpu(rows: int) -> None:
    """Qwen3-VL-30B-A3B's experts with 128 x 128 tiles and Gemma 4 26B-A4B's (GELU; down's K of 704 is not whole
    tiles) with row scales and with tiles, in bf16, at a decode batch (the Triton kernels) and a prefill chunk (the
    grouped FP8 GEMMs), against the same block holding the dequantized weights. Stated tolerance: RMS error within
    5 % of the output's (e4m3 activations carry ~3 %)."""
    from workers.engine.models.fp8_layers import _convert_experts, _dummy_tiles
    from workers.engine.models.gemma4.moe import GemmaExperts
    from workers.engine.models.qwen3_vl.moe import SparseMoeBlock

    torch.manual_seed(0)
    qwen = SparseMoeBlock(2048, 128, 8, 768).to("cuda", torch.bfloat16)
    gemma = GemmaExperts(128, 2816, 704).to("cuda", torch.bfloat16)
    for experts in (qwen.experts, gemma):
        for stack in (experts.gate_up_proj, experts.down_proj):
            stack.data.normal_(std=stack.shape[2] ** -0.5)
    qwen.gate.weight.data.normal_(std=2048**-0.5)
    plain_qwen = SparseMoeBlock(2048, 128, 8, 768).to("cuda", torch.bfloat16)
    plain_qwen.load_state_dict(qwen.state_dict())
    plain_gemma = GemmaExperts(128, 2816, 704).to("cuda", torch.bfloat16)
    plain_gemma.load_state_dict(gemma.state_dict())
    gemma_tiles = GemmaExperts(128, 2816, 704).to("cuda", torch.bfloat16)
    gemma_tiles.load_state_dict(gemma.state_dict())
    for tiled in (qwen.experts, gemma_tiles):
        assert _convert_experts(tiled, (_dummy_tiles(tiled.gate_up_proj, gate_up=True), _dummy_tiles(tiled.down_proj))) == 1
    assert _convert_experts(gemma) == 1
    plain_tiles = GemmaExperts(128, 2816, 704).to("cuda", torch.bfloat16)
    for block, plain in ((qwen.experts, plain_qwen.experts), (gemma, plain_gemma), (gemma_tiles, plain_tiles)):
        scales = block.fp8_scales()
        assert scales is not None
        plain.gate_up_proj.data.copy_(dequantize(block.gate_up_proj, scales[0]))
        plain.down_proj.data.copy_(dequantize(block.down_proj, scales[1]))

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        return bool((got.float() - want.float()).pow(2).mean().sqrt() <= 0.05 * want.float().pow(2).mean().sqrt())

    with torch.inference_mode():
        x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
        assert close(qwen.routed(x), plain_qwen.routed(x))
        xg = torch.randn(rows, 2816, device="cuda", dtype=torch.bfloat16)
        weights = torch.softmax(torch.randn(rows, 8, device="cuda"), dim=-1)
        ids = torch.stack([torch.randperm(128, device="cuda")[:8] for _ in range(rows)])
        assert close(gemma(xg, weights, ids), plain_gemma(xg, weights, ids))
        assert close(gemma_tiles(xg, weights, ids), plain_tiles(xg, weights, ids))
