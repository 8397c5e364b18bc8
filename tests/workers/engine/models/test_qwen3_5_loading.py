"""Loading Qwen3.5 checkpoints: the Hub's tensor names (the demo checkpoints hold them), the MTP head skipped without a
word, the zero-centred norms' +1, every layout of MoE experts, missing or unknown language-model tensors refused;
and tensor parallelism: each rank's shard of every layer kind checked head by head against the checkpoint, and a
TP=2 run over gloo answering as TP=1."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from tests.workers.engine.models.lm_harness import run_tp_ranks
from tests.workers.engine.models.qwen3_5_harness import (  # noqa: F401 (single_thread: an autouse fixture)
    HybridCache,
    greedy,
    load_ours,
    single_thread,
)
from workers.engine.layers.linear import TPGroup
from workers.engine.models.loader import normalize_name

LM = "model.language_model."


def checkpoint(model_dir: Path) -> dict[str, Tensor]:
    return load_file(model_dir / "model.safetensors")


def test_hub_names_load_and_the_mtp_head_is_skipped_silently(
    qwen3_5_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    names = set(checkpoint(qwen3_5_model_dir))
    assert f"{LM}layers.0.linear_attn.in_proj_qkv.weight" in names and f"{LM}layers.3.self_attn.q_proj.weight" in names
    mtp = sorted(n for n in names if n.startswith("mtp."))
    assert mtp and all(not normalize_name(n).startswith(("lm.", "visual.")) for n in mtp)
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_ours(qwen3_5_model_dir)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not any("mtp" in n for n, _ in model.named_parameters())
    # An unknown language-model tensor is an error, not skipped; so is a missing part of a fused parameter.
    with pytest.raises(KeyError, match="in_proj_q"):
        model.lm.load_weights([("lm.layers.0.linear_attn.in_proj_q.weight", torch.zeros(1))], partial=True)
    lm_weights = [(normalize_name(n), t) for n, t in checkpoint(qwen3_5_model_dir).items()]
    fresh = load_ours(qwen3_5_model_dir).lm
    fresh._loaded.clear()
    with pytest.raises(ValueError, match=r"layers\.1\.linear_attn\.in_proj\.weight"):
        fresh.load_weights([(n, t) for n, t in lm_weights if n.startswith("lm.") and "1.linear_attn.in_proj_a" not in n])


def test_zero_centred_norms_take_one_plus_the_weight(qwen3_5_model_dir: Path) -> None:
    ckpt = checkpoint(qwen3_5_model_dir)
    params = dict(load_ours(qwen3_5_model_dir).lm.named_parameters())
    for name in ("norm.weight", "layers.0.input_layernorm.weight", "layers.3.post_attention_layernorm.weight",
                 "layers.3.self_attn.q_norm.weight", "layers.3.self_attn.k_norm.weight"):
        assert torch.equal(params[name], ckpt[LM + name] + 1), name
    assert torch.equal(params["layers.0.linear_attn.norm.weight"], ckpt[LM + "layers.0.linear_attn.norm.weight"])


def test_every_expert_layout_loads_alike(qwen3_5_moe_model_dir: Path, tmp_path: Path) -> None:
    """The Hub's one tensor per expert (the demo), transformers' in-memory fused [E, 2I, H] / [E, H, I], and the
    fused x @ W layout [E, H, 2I] / [E, I, H] of Qwen3-VL-MoE's Hub checkpoints."""
    per_expert = checkpoint(qwen3_5_moe_model_dir)
    expected = dict(load_ours(qwen3_5_moe_model_dir).lm.state_dict())
    for transpose in (False, True):
        fused: dict[str, Tensor] = {}
        for name, tensor in per_expert.items():
            if ".mlp.experts." not in name:
                fused[name] = tensor
            elif name.endswith(".0.gate_proj.weight"):
                base = name[: -len("0.gate_proj.weight")]
                gate_up = torch.stack([torch.cat([per_expert[f"{base}{e}.gate_proj.weight"],
                                                  per_expert[f"{base}{e}.up_proj.weight"]]) for e in range(8)])
                down = torch.stack([per_expert[f"{base}{e}.down_proj.weight"] for e in range(8)])
                if transpose:
                    gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
                fused[base + "gate_up_proj"], fused[base + "down_proj"] = gate_up.contiguous(), down.contiguous()
        out = tmp_path / f"fused-{transpose}"
        out.mkdir()
        for file in qwen3_5_moe_model_dir.iterdir():
            if file.name != "model.safetensors":
                (out / file.name).write_bytes(file.read_bytes())
        save_file(fused, out / "model.safetensors")
        got = load_ours(out).lm.state_dict()
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected), transpose


def _rows(t: Tensor, heads: range, width: int) -> Tensor:
    """The rows of heads ``heads`` (``width`` rows each) of a per-head tensor."""
    return t[heads.start * width : heads.stop * width]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tp2_shards_are_whole_heads(
    kind: str, qwen3_5_model_dir: Path, qwen3_5_moe_model_dir: Path
) -> None:
    """Each rank (loaded without a process group) holds whole heads: key head r of Gated DeltaNet with the value heads
    that read it (2r, 2r+1), attention heads 2r, 2r+1 with their gates and KV head r; expert and MLP widths halved."""
    model_dir = qwen3_5_moe_model_dir if kind == "moe" else qwen3_5_model_dir
    ckpt = {normalize_name(n)[3:]: t for n, t in checkpoint(model_dir).items() if normalize_name(n).startswith("lm.")}
    layers = load_ours(model_dir).spec.text.layer_types
    lin, full = layers.index("linear_attention"), layers.index("full_attention")
    for r in (0, 1):
        p = dict(load_ours(model_dir, TPGroup(rank=r, size=2)).lm.named_parameters())
        a = f"layers.{lin}.linear_attn."
        qkv = ckpt[a + "in_proj_qkv.weight"]  # [q 2x16 | k 2x16 | v 4x16]
        key, value = range(r, r + 1), range(2 * r, 2 * r + 2)
        sections = [_rows(qkv[:32], key, 16), _rows(qkv[32:64], key, 16), _rows(qkv[64:], value, 16)]
        assert torch.equal(p[a + "conv1d.weight"], _rows_cat(ckpt[a + "conv1d.weight"], key, value))
        expected = torch.cat([*sections, _rows(ckpt[a + "in_proj_z.weight"], value, 16),
                              _rows(ckpt[a + "in_proj_b.weight"], value, 1), _rows(ckpt[a + "in_proj_a.weight"], value, 1)])
        assert torch.equal(p[a + "in_proj.weight"], expected)
        for vec in ("A_log", "dt_bias"):
            assert torch.equal(p[a + vec], ckpt[a + vec][2 * r : 2 * r + 2])
        assert torch.equal(p[a + "norm.weight"], ckpt[a + "norm.weight"])  # one value head wide: replicated
        assert torch.equal(p[a + "out_proj.weight"], ckpt[a + "out_proj.weight"][:, 32 * r : 32 * r + 32])
        s = f"layers.{full}.self_attn."
        q_gate = _rows(ckpt[s + "q_proj.weight"], range(2 * r, 2 * r + 2), 64)  # each head [query 32 | gate 32]
        kv = [_rows(ckpt[s + f"{x}_proj.weight"], key, 32) for x in "kv"]
        assert torch.equal(p[s + "qkv_proj.weight"], torch.cat([q_gate, *kv]))
        assert torch.equal(p[s + "o_proj.weight"], ckpt[s + "o_proj.weight"][:, 64 * r : 64 * r + 64])
        m = f"layers.{lin}.mlp."
        if kind == "moe":
            half = slice(24 * r, 24 * r + 24)
            gate_up = p[m + "experts.gate_up_proj"]
            assert gate_up.shape == (8, 48, 64)
            assert torch.equal(gate_up[5], torch.cat([ckpt[m + "experts.5.gate_proj.weight"][half],
                                                      ckpt[m + "experts.5.up_proj.weight"][half]]))
            assert torch.equal(p[m + "experts.down_proj"][5], ckpt[m + "experts.5.down_proj.weight"][:, half])
            shared = slice(48 * r, 48 * r + 48)
            assert torch.equal(p[m + "shared_expert.gate_up_proj.weight"],
                               torch.cat([ckpt[m + f"shared_expert.{x}_proj.weight"][shared] for x in ("gate", "up")]))
            assert torch.equal(p[m + "shared_expert_gate.weight"], ckpt[m + "shared_expert_gate.weight"])
            assert torch.equal(p[m + "gate.weight"], ckpt[m + "gate.weight"])
        else:
            assert p[m + "gate_up_proj.weight"].shape == (128, 64) and p[m + "down_proj.weight"].shape == (64, 64)


def _rows_cat(conv: Tensor, key: range, value: range) -> Tensor:
    """A conv1d weight's channels of these key and value heads (q | k | v sections, 16 channels a head)."""
    return torch.cat([_rows(conv[:32], key, 16), _rows(conv[32:64], key, 16), _rows(conv[64:], value, 16)])


PROMPTS = {"a": torch.arange(3, 40) * 37 % 2000, "b": torch.arange(5, 24) * 53 % 2000}
PLAN = [{"a": 5, "b": 9}, {"a": 16, "b": 10}, {"a": 16}]


def _scenario(model_dir: Path, tp: TPGroup) -> dict[str, list[int]]:
    return greedy(HybridCache(load_ours(model_dir, tp).lm), PROMPTS, PLAN, 6)


def _tp_run(tp: TPGroup, dirs: list[str]) -> list[dict[str, list[int]]]:
    return [_scenario(Path(d), tp) for d in dirs]


def test_tp2_over_gloo_answers_as_tp1(qwen3_5_model_dir: Path, qwen3_5_moe_model_dir: Path, tmp_path: Path) -> None:
    """Two real ranks (all-reduces after out_proj, o_proj, the MLPs and MoE blocks; gathered logits), two sequences
    sharing chunked-prefill and decode steps: the same greedy tokens as one rank."""
    dirs = [qwen3_5_model_dir, qwen3_5_moe_model_dir]
    expected = [_scenario(d, TPGroup()) for d in dirs]
    for rank_result in run_tp_ranks(_tp_run, 2, tmp_path, [str(d) for d in dirs]):
        assert rank_result == expected
