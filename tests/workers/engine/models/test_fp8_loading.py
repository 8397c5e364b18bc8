"""Loading FP8 checkpoints: which ``quantization_config`` is accepted (and the one start-up line for the others), the
weight/scale pairing, the vision tower kept in the model dtype, the FP8 layers' plumbing (exercised on the CPU by
letting the loader build them), and on a GPU the FP8 model's logits against the dequantized model's."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from server.serve_cli import add_serve
from server.serve_config import build_config
from tests.conftest import noise_image
from tests.workers.engine.models.engine_harness import GREEDY, chat, make_engine
from tests.workers.engine.models.lm_harness import PagedCache
from workers.engine.kernels import fp8_gemm
from workers.engine.kernels.fp8_quant import FP8, dequantize, quantize_block, quantize_rows
from workers.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
)
from workers.engine.models import family, load_spec
from workers.engine.models.demo_quantize import quantization_config
from workers.engine.models.fp8_layers import convert_to_fp8
from workers.engine.models.gemma4.moe import GemmaExperts
from workers.engine.models.load import load_model
from workers.engine.models.quantization import (
    Fp8Scheme,
    UnsupportedQuantization,
    dequantized,
    parse_quantization,
)

SUPPORTED = (
    "glimpse loads fp8 (128x128 weight blocks, dynamic activations) and compressed-tensors float-quantized FP8 "
    "(channel or 128x128-block weights, dynamic per-token or per-group activations)"
)


def test_both_published_configs_parse() -> None:
    block = parse_quantization({"quantization_config": quantization_config("fp8-block", ["model.visual.x"])})
    assert block == Fp8Scheme("fp8", 128, "_scale_inv", ("lm_head", "model.visual.x"))
    ct = parse_quantization({"text_config": {"quantization_config": quantization_config("fp8-dynamic", [])}})
    assert ct is not None and (ct.method, ct.block, ct.scale_suffix) == ("compressed-tensors", None, "_scale")
    assert "re:.*mlp.gate$" in ct.ignore and parse_quantization({}) is None


def _ct(**weights: Any) -> dict[str, Any]:
    qc = quantization_config("fp8-dynamic", [])
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return qc


@pytest.mark.parametrize(
    ("qc", "why"),
    [
        ({"quant_method": "awq", "bits": 4}, "'awq' is not supported (not an FP8 format)"),
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported (not an FP8 format)"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "'fp8' is not supported (weight_block_size [64, 64], only [128, 128])"),
        ({"quant_method": "fp8"}, "'fp8' is not supported (weight_block_size None, only [128, 128])"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
         "'fp8' is not supported (activation_scheme 'static', only dynamic)"),
        (_ct(strategy="tensor"), "'compressed-tensors' is not supported (group_0: weight strategy 'tensor', only channel or block [128, 128])"),
        (_ct(num_bits=4, type="int"), "'compressed-tensors' is not supported (group_0: weights int 4-bit, only static symmetric 8-bit float)"),
    ],
)
def test_unsupported_methods_name_themselves_in_one_line(qc: dict[str, Any], why: str) -> None:
    with pytest.raises(UnsupportedQuantization) as info:
        parse_quantization({"quantization_config": qc})
    assert str(info.value) == f"quantization method {why}; {SUPPORTED}"


def test_glimpse_serve_stops_at_start_up_with_the_line(demo_model_dir: Path, tmp_path: Path) -> None:
    model = shutil.copytree(demo_model_dir, tmp_path / "gptq")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(config))
    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers())
    with pytest.raises(SystemExit) as info:
        build_config(parser.parse_args(["serve", "--model", str(model), "--device", "cpu"]))
    assert str(info.value) == f"glimpse serve: quantization method 'gptq' is not supported (not an FP8 format); {SUPPORTED}"


def test_weights_meet_their_scales_in_any_order_and_lone_halves_fail() -> None:
    q, s = quantize_block(torch.randn(130, 140))
    scheme = Fp8Scheme("fp8", 128, "_scale_inv", ())
    bias = torch.ones(3)
    stream = [("a.weight_scale_inv", s), ("b.bias", bias), ("a.weight", q), ("c.per_expert_scale", bias)]
    out = dict(dequantized(stream, scheme, record := {}))
    assert list(out) == ["b.bias", "a.weight", "c.per_expert_scale"]
    assert list(record) == ["a.weight"] and record["a.weight"][0] is s and record["a.weight"][1] == (130, 140)
    assert torch.equal(out["a.weight"], dequantize(q, s)) and out["b.bias"] is bias
    with pytest.raises(ValueError, match="weights without scales or scales without weights: a.weight"):
        list(dequantized([("a.weight", q)], scheme))
    with pytest.raises(UnsupportedQuantization, match="static scale a.input_scale"):
        list(dequantized([("a.input_scale", s)], scheme))


def test_an_fp8_vision_weight_is_dequantized_into_the_model_dtype(fp8_demo: Callable[[str, str], Path], tmp_path: Path) -> None:
    """The ViT always runs in the model dtype: a checkpoint that stores one of its weights in FP8 is read dequantized."""
    model_dir = shutil.copytree(fp8_demo("qwen3_vl", "fp8-block"), tmp_path / "fp8-vit")
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.visual.blocks.0.attn.qkv.weight"
    tensors[name], tensors[name + "_scale_inv"] = quantize_block(tensors[name])
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    spec = load_spec(model_dir)
    built = family(spec.family).build(spec, TPGroup(), torch.bfloat16, torch.device("cpu"), "auto")
    model = load_model(built, model_dir)
    qkv = model.vision.blocks[0].attn.qkv.weight
    assert qkv.dtype == torch.bfloat16
    assert torch.equal(qkv, dequantize(tensors[name], tensors[name + "_scale_inv"]).to(torch.bfloat16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # no FP8 layer on the CPU either


def test_block_scales_follow_a_fused_shard_and_become_tiles_when_aligned() -> None:
    """gate/up fused at TP 1: aligned halves (256 + 128 rows) keep 128 x 128 tiles, a 96-row half leaves per-row
    block scales; either way the layer holds the checkpoint's FP8 values."""
    for sizes, tiles in (((256, 128), True), ((96, 96), False)):
        layer = MergedColumnParallelLinear(256, list(sizes), bias=False)
        lm = torch.nn.ModuleDict({"gate_up_proj": layer})
        record, stored = {}, []
        for shard, rows in enumerate(sizes):
            q, s = quantize_block(torch.randn(rows, 256))
            layer.weight_loader(layer.weight, dequantize(q, s), shard)
            record[f"gate_up_proj.weight#{shard}"] = (s, q.shape)
            stored.append(q)
        routes = {f"gate_up_proj.weight#{i}": ("gate_up_proj.weight", i) for i in range(2)}
        lm.route = lambda name, routes=routes: routes[name]  # type: ignore[assignment]
        assert convert_to_fp8(lm, {"lm." + k: v for k, v in record.items()}, 128) == 1
        assert torch.equal(layer.weight.float(), torch.cat(stored).float())
        assert layer.weight_scale is not None
        assert layer.weight_scale.shape == ((3, 2) if tiles else (192, 2))


@pytest.mark.parametrize("block", [128, None])
@pytest.mark.parametrize("rank", [0, 1])
def test_scales_follow_the_rank_shard_at_tp2(rank: int, block: int | None) -> None:
    """TP 2 without communication (loading and conversion are per rank): a row-parallel down projection takes its
    128-column blocks (or keeps every row's scale), a column-parallel q/k/v its rows, each with the checkpoint's
    values and scales."""
    tp = TPGroup(rank=rank, size=2)
    down = RowParallelLinear(512, 256, bias=False, tp=tp)
    qkv = QKVParallelLinear(256, 128, 4, 2, bias=False, tp=tp)  # q 512 rows, k and v 256 each
    lm = torch.nn.ModuleDict({"down": down, "qkv": qkv})
    record, full, scales = {}, {}, {}
    for name, rows, cols, layer, shard in (("down", 256, 512, down, None), ("q", 512, 256, qkv, "q"),
                                           ("k", 256, 256, qkv, "k"), ("v", 256, 256, qkv, "v")):
        q, s = (quantize_block if block else quantize_rows)(torch.randn(rows, cols))
        layer.weight_loader(layer.weight, dequantize(q, s), shard)
        record[f"lm.{name}"], full[name], scales[name] = (s, q.shape), q, s
    routes = {"down": ("down.weight", None), "q": ("qkv.weight", "q"), "k": ("qkv.weight", "k"), "v": ("qkv.weight", "v")}
    lm.route = lambda name: routes[name]  # type: ignore[assignment]
    assert convert_to_fp8(lm, record, block) == 2
    assert torch.equal(down.weight.float(), full["down"][:, 256 * rank : 256 * (rank + 1)].float())
    assert down.weight_scale is not None and qkv.weight_scale is not None
    halves = [full[p][len(full[p]) // 2 * rank :][: len(full[p]) // 2] for p in "qkv"]
    assert torch.equal(qkv.weight.float(), torch.cat(halves).float())
    if block:  # 128 x 128 tiles of each shard
        assert down.weight_scale.shape == (2, 2) and qkv.weight_scale.shape == (4, 2)
    else:  # the stored per-row scales: all of down's rows, this rank's q/k/v rows
        assert torch.equal(down.weight_scale, scales["down"])
        assert torch.equal(qkv.weight_scale, torch.cat([scales[p][len(scales[p]) // 2 * rank :][: len(scales[p]) // 2] for p in "qkv"]))


def test_a_fused_layer_with_a_part_kept_in_the_model_dtype_stays_unconverted() -> None:
    layer = MergedColumnParallelLinear(256, [128, 128], bias=False)
    lm = torch.nn.ModuleDict({"gate_up_proj": layer})
    q, s = quantize_block(torch.randn(128, 256))
    layer.weight_loader(layer.weight, dequantize(q, s), 0)
    layer.weight_loader(layer.weight, torch.randn(128, 256), 1)  # up_proj in bf16, as a modules_to_not_convert entry
    lm.route = lambda name: ("gate_up_proj.weight", 0)  # type: ignore[assignment]
    assert convert_to_fp8(lm, {"lm.gate_proj": (s, q.shape)}, 128) == 0
    assert layer.weight.dtype == torch.float32 and layer.weight_scale is None


def _always(*_: Any) -> bool:
    return True


@pytest.mark.parametrize("fmt", ["fp8-dynamic", "fp8-block"])
def test_fp8_layers_built_on_the_cpu_give_the_dequantized_models_tokens(
    fmt: str, fp8_demo: Callable[[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA path's plumbing without CUDA: the loader is made to build FP8 layers (TP linears through
    fp8_gemm.linear, stacked experts with scales), which on the CPU compute through the dequantized fallbacks and
    must give the tokens of the model that was never converted. A block checkpoint's experts keep its tiles (its
    fused [E, 2I, H] tensors, intermediate rows that are not whole tiles: a scale per row and 128 columns)."""
    model_dir = fp8_demo("qwen3_5_moe", fmt)
    messages = chat("What is in the picture?", [noise_image(40, 40)])
    [plain] = make_engine(model_dir).generate([messages], GREEDY)
    with monkeypatch.context() as m:  # only while loading: the forward must take the CPU fallbacks
        m.setattr(fp8_gemm, "wants_fp8_layers", _always)
        m.setattr(fp8_gemm, "grouped_usable", _always)
        engine = make_engine(model_dir)
    lm = engine.runner.model.lm
    experts, shared = lm.layers[0].mlp.experts, lm.layers[0].mlp.shared_expert
    assert experts.gate_up_proj.dtype == FP8 and experts.gate_up_scale is not None
    assert experts.gate_up_scale.shape[-1] == (1 if fmt == "fp8-dynamic" else -(-experts.hidden_size // 128))
    assert shared.down_proj.weight.dtype == FP8 and lm.layers[0].linear_attn.out_proj.weight.dtype == FP8
    assert lm.layers[0].mlp.gate.weight.dtype == torch.float32  # the router stays as it is, as does lm_head
    assert lm.lm_head.weight.dtype == torch.float32
    [fp8] = engine.generate([messages], GREEDY)
    assert fp8.token_ids == plain.token_ids


@pytest.mark.parametrize("fmt", ["fp8-dynamic", "fp8-block"])
def test_gemma_experts_become_fp8_and_keep_the_dequantized_models_tokens(
    fmt: str, fp8_demo: Callable[[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 4's experts (a GELU gate, their own block class) are FP8 stacks too; on the CPU they compute through
    their dequantized copies and give the tokens of the model that was never converted."""
    model_dir = fp8_demo("gemma4_moe", fmt)
    messages = chat("What is in the picture?", [noise_image(48, 48)])
    [plain] = make_engine(model_dir).generate([messages], GREEDY)
    with monkeypatch.context() as m:
        m.setattr(fp8_gemm, "wants_fp8_layers", _always)
        m.setattr(fp8_gemm, "grouped_usable", _always)
        engine = make_engine(model_dir)
    experts = [m for m in engine.runner.model.lm.modules() if isinstance(m, GemmaExperts)]
    assert experts and all(e.gate_up_proj.dtype == FP8 and e.down_proj.dtype == FP8 for e in experts)
    [fp8] = engine.generate([messages], GREEDY)
    assert fp8.token_ids == plain.token_ids


def test_dummy_weights_with_an_fp8_config_get_fp8_layers(
    fp8_demo: Callable[[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--load-format dummy`` over an FP8 config.json: FP8 layers from the random weights (for measuring)."""
    model_dir = fp8_demo("qwen3_5_moe", "fp8-dynamic")
    monkeypatch.setattr(fp8_gemm, "wants_fp8_layers", _always)
    monkeypatch.setattr(fp8_gemm, "grouped_usable", _always)
    spec = load_spec(model_dir)
    model = load_model(family(spec.family).build(spec, TPGroup(), torch.float32, torch.device("cpu"), "auto"),
                       model_dir, load_format="dummy")
    layer = model.lm.layers[0]
    assert layer.mlp.experts.down_proj.dtype == FP8 and layer.linear_attn.in_proj.weight.dtype == FP8
    assert layer.linear_attn.in_proj.weight_scale.shape == (layer.linear_attn.in_proj.weight.shape[0], 1)
    assert model.lm.lm_head.weight.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)), reason="needs FP8 CUDA")
def test_fp8_logits_match_the_dequantized_model_on_gpu(
    fp8_demo: Callable[[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 on CUDA: the FP8 model (row-wise FP8 GEMMs, activations quantized per token) against the same checkpoint
    dequantized (GLIMPSE_FP8_GEMM=bf16). Stated tolerance: logits' RMS error within 5% of their RMS, and the same
    greedy next token at 90% of positions (e4m3 activations carry ~3% relative error per GEMM)."""
    model_dir = fp8_demo("qwen3_vl", "fp8-dynamic")
    spec = load_spec(model_dir)
    ids = torch.tensor([(i * 37) % 1500 + 20 for i in range(64)], device="cuda")
    logits = []
    for variant in ("auto", "bf16"):
        monkeypatch.setenv(fp8_gemm.VARIANT_ENV, variant)
        built = family(spec.family).build(spec, TPGroup(), torch.bfloat16, torch.device("cuda"), "sdpa")
        model = load_model(built, model_dir)
        fp8 = [p for p in model.lm.parameters() if p.dtype == FP8]
        assert bool(fp8) == (variant == "auto")
        cache = PagedCache(model.lm, device="cuda", dtype=torch.bfloat16)
        meta, _ = cache.schedule([("a", len(ids))])
        positions = torch.arange(len(ids), device="cuda").repeat(3, 1)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(model.embed(ids), positions, cache.caches, meta)))
    got, ref = logits
    assert (got - ref).pow(2).mean().sqrt() <= 0.05 * ref.pow(2).mean().sqrt()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_per_row_scales_of_stacked_experts_dequantize_per_expert() -> None:
    w = torch.randn(3, 8, 16)
    q, s = quantize_rows(w)
    assert s.shape == (3, 8, 1)
    torch.testing.assert_close(dequantize(q, s), w, rtol=0.07, atol=0.0)
