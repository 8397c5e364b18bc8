"""glimpse's Qwen3-VL language model, dense and MoE, against transformers on tiny random checkpoints (CPU, float32):
paged multimodal batches with DeepStack rows, over every expert layout and over real TP ranks; and its fused CUDA
kernels against eager (bf16). Config parsing: test_qwen3_lm_config.py; expert loading: test_qwen3_moe_loading.py; the
expert kernels alone: test_qwen3_moe_kernels.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from tests.workers.engine.models.lm_harness import PagedCache, run_tp_ranks
from tests.workers.engine.models.qwen3_tiny import (
    FORMATS,
    HIDDEN,
    TEXT_CONFIG,
    checkpoint_dir,
    load_ours,
)
from workers.engine.kernels import fused
from workers.engine.layers.linear import TPGroup
from workers.engine.models.loader import fill_dummy_weights
from workers.engine.models.qwen3_vl.lm import (
    Qwen3VLLanguageModel,
    RotaryTables,
    TextSpec,
    build_language_model,
    mrope_rows,
)
from workers.engine.models.qwen3_vl.moe import SparseMoeBlock, grouped_mm_usable

ATOL = 1e-4
LEVELS = 2  # DeepStack levels: added after decoder layers 0 and 1 (of 3)


# ---------------------------------------------------------------- a multimodal batch


@dataclass
class Seq:
    """One prompt: token ids, its [3, T] M-RoPE positions, image rows (sorted) and their DeepStack features."""

    ids: Tensor
    positions: Tensor
    image_rows: Tensor
    features: Tensor  # [len(image_rows), LEVELS * HIDDEN]


def make_seq(n: int, image: tuple[int, int, int] | None, seed: int) -> Seq:
    """n tokens; ``image`` = (start, h, w) puts an h x w image span there (t/h/w rows differ inside it)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TEXT_CONFIG["vocab_size"], (n,), generator=gen)
    if image is None:
        pos = torch.arange(n).expand(3, -1).clone()
        return Seq(ids, pos, torch.zeros(0, dtype=torch.long), torch.zeros(0, LEVELS * HIDDEN))
    start, h, w = image
    span = h * w
    i = torch.arange(span)
    img = torch.stack([torch.full((span,), start), start + i // w, start + i % w])
    after = torch.arange(n - start - span) + start + max(h, w)
    pos = torch.cat([torch.arange(start).expand(3, -1), img, after.expand(3, -1)], dim=1)
    feats = torch.randn(span, LEVELS * HIDDEN, generator=gen) * 0.5
    return Seq(ids, pos, torch.arange(start, start + span), feats)


@dataclass
class PagedRunner:
    """Drives our model step by step through a paged cache whose blocks are handed out in shuffled order."""

    model: Qwen3VLLanguageModel
    seed: int = 0
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    num_blocks: int = 48

    def __post_init__(self) -> None:
        self.cache = PagedCache(self.model, self.seed, self.num_blocks, self.device, self.dtype)

    @property
    def tables(self) -> dict[str, list[int]]:
        return self.cache.tables

    def step(self, chunks: list[tuple[str, int]], seqs: dict[str, Seq]) -> list[Tensor]:
        """One flattened forward over ``(seq, n_new_tokens)`` chunks; returns each chunk's final hidden."""
        meta, starts = self.cache.schedule(chunks)
        ids, pos, rows, feats = [], [], [], []
        offset = 0
        for (name, n), start in zip(chunks, starts, strict=True):
            seq = seqs[name]
            ids.append(seq.ids[start : start + n])
            pos.append(seq.positions[:, start : start + n])
            inside = (seq.image_rows >= start) & (seq.image_rows < start + n)
            rows.append(seq.image_rows[inside] - start + offset)  # this chunk's image rows, as batch rows
            feats.append(seq.features[inside])
            offset += n
        dev = self.device
        batch_rows = torch.cat(rows).to(dev)
        feat = torch.cat(feats).to(dev, self.dtype)
        deepstack = (batch_rows, feat) if batch_rows.numel() else None
        with torch.no_grad():
            embeds = self.model.embed_tokens(torch.cat(ids).to(dev))
            caches = self.cache.caches
            hidden = self.model(embeds, torch.cat(pos, dim=1).to(dev), caches, meta, deepstack=deepstack)
        return list(hidden.split([n for _, n in chunks]))


def scenario_seqs() -> dict[str, Seq]:
    return {
        "a": make_seq(22, image=(4, 2, 4), seed=1),  # an image split over two prefill chunks
        "b": make_seq(11, image=(2, 2, 2), seed=2),  # an image in the second sequence of a batch
        "c": make_seq(7, image=None, seed=3),  # text only
    }


# Chunked prefill, mixed prefill/decode batches, decodes (which carry no DeepStack rows).
PLAN: list[list[tuple[str, int]]] = [
    [("a", 9), ("c", 7)],
    [("b", 9), ("a", 10)],
    [("a", 1), ("b", 1)],
    [("b", 1), ("a", 1)],
    [("a", 1)],
]


def run_scenario(model: Qwen3VLLanguageModel) -> dict[str, Tensor]:
    """Each sequence's final hidden states over the whole plan, in token order."""
    seqs, runner = scenario_seqs(), PagedRunner(model, seed=5)
    got: dict[str, list[Tensor]] = {s: [] for s in seqs}
    for chunks in PLAN:
        for (name, _), hidden in zip(chunks, runner.step(chunks, seqs), strict=True):
            got[name].append(hidden)
    assert all(runner.tables[s] != sorted(runner.tables[s]) for s in ("a", "b")), "want shuffled blocks"
    return {s: torch.cat(h) for s, h in got.items()}


def hf_hidden(hf: Any, seq: Seq) -> Tensor:
    """transformers' final hidden states for one whole sequence, DeepStack features at its image rows."""
    lm = hf.model.language_model
    extra: dict[str, Any] = {}
    if seq.image_rows.numel():
        mask = torch.zeros(1, seq.ids.shape[0], dtype=torch.bool)
        mask[0, seq.image_rows] = True
        extra = {"visual_pos_masks": mask, "deepstack_visual_embeds": list(seq.features.split(HIDDEN, dim=1))}
    with torch.no_grad():
        out = lm(
            inputs_embeds=lm.embed_tokens(seq.ids)[None],
            position_ids=seq.positions[:, None],
            use_cache=False,
            **extra,
        )
    hidden: Tensor = out.last_hidden_state[0]
    return hidden


# ---------------------------------------------------------------- against transformers


def test_interleaved_rotary_tables_equal_transformers(qwen3_tiny: dict[str, tuple[Path, Any]]) -> None:
    _, hf = qwen3_tiny["dense"]
    assert mrope_rows((2, 3, 3), True) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert mrope_rows((24, 20, 20), True)[57:] == [0, 1, 2, 0, 0, 0, 0]  # h, w stop at 3*20; t keeps 60..63
    assert mrope_rows((2, 3, 3), False) == [0, 0, 1, 1, 1, 2, 2, 2]
    positions = torch.randint(0, 5000, (3, 37))
    rotary = RotaryTables(16, 10000.0, mrope_rows((2, 3, 3), True))
    cos, sin_signed = rotary(positions, torch.float32)
    ref_cos, ref_sin = hf.model.language_model.rotary_emb(torch.zeros(1), positions[:, None])
    assert torch.equal(cos[:, 0], ref_cos[0]) and torch.equal(sin_signed[:, 0, 8:], ref_sin[0, :, 8:])
    assert torch.equal(sin_signed[:, 0, :8], -ref_sin[0, :, :8])


@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_multimodal_batches_match_transformers(
    qwen3_tiny: dict[str, tuple[Path, Any]], tmp_path: Path, fmt: str
) -> None:
    """Chunked prefill with DeepStack rows split across chunks and batch positions, then decodes."""
    path, hf = checkpoint_dir(qwen3_tiny, fmt, tmp_path)
    model = load_ours(path)
    if fmt != "dense":
        assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)
    got = run_scenario(model)
    for name, seq in scenario_seqs().items():
        expected = hf_hidden(hf, seq)
        torch.testing.assert_close(got[name], expected, atol=ATOL, rtol=0)
        logits = model.compute_logits(got[name])
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, hf.lm_head(expected), atol=ATOL, rtol=0)
    # Without DeepStack the image rows' hidden states must differ (the features are really added).
    seq = scenario_seqs()["a"]
    plain = Seq(seq.ids, seq.positions, seq.image_rows[:0], seq.features[:0])
    assert not torch.allclose(hf_hidden(hf, plain)[4:12], got["a"][4:12], atol=1e-3)


def test_tied_embeddings_share_one_weight(qwen3_tiny: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    path, _ = qwen3_tiny["dense"]
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if k != "lm_head.weight"}
    save_file(tensors, tmp_path / "model.safetensors")
    tied = load_ours(tmp_path)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    h = torch.randn(3, HIDDEN)
    embed = tensors["model.language_model.embed_tokens.weight"]
    torch.testing.assert_close(tied.compute_logits(h), h @ embed.T)


# ---------------------------------------------------------------- tensor parallelism (gloo, CPU)


def _tp_run(tp: TPGroup, dirs: dict[str, str]) -> dict[str, dict[str, Tensor]]:
    """One TP rank: load each checkpoint's shards, run the scenario; the hidden states per checkpoint."""
    return {fmt: run_scenario(load_ours(Path(d), tp)) for fmt, d in dirs.items()}


def test_tensor_parallel_over_gloo_matches_transformers(
    qwen3_tiny: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """TP=2 (one KV head per rank; every expert's intermediate dim halved) for dense and both MoE layouts."""
    dirs = {
        fmt: str(checkpoint_dir(qwen3_tiny, fmt, tmp_path)[0]) for fmt in ("dense", "moe_hub", "moe_per_expert")
    }
    seqs = scenario_seqs()
    for results in run_tp_ranks(_tp_run, 2, tmp_path, dirs):
        for fmt in dirs:
            hf = qwen3_tiny["dense" if fmt == "dense" else "moe"][1]
            for name, seq in seqs.items():
                torch.testing.assert_close(results[fmt][name], hf_hidden(hf, seq), atol=ATOL, rtol=0)


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_fused_kernels_match_eager() -> None:
    """Dense LM (compiled q/k-norm + rope, add + norm, SiLU*up; DeepStack rows) and one MoE block (grouped
    experts) on CUDA in bf16 against their eager paths. The block is compared alone, on one input: in a
    whole MoE model, bf16 rounding differences flip a few tokens' top-k choices, and those tokens differ
    by design."""
    spec = TextSpec.from_hf_config({"text_config": TEXT_CONFIG})
    model = build_language_model(spec, dtype=torch.bfloat16, device="cuda", attn_backend="sdpa")
    fill_dummy_weights(model, seed=3, std=0.05)
    seqs = {"a": make_seq(300, image=(20, 8, 16), seed=1)}

    def run() -> Tensor:
        runner = PagedRunner(model, device="cuda", dtype=torch.bfloat16, num_blocks=80)
        return torch.cat(runner.step([("a", 200)], seqs) + runner.step([("a", 100)], seqs)).float()

    eager = run()
    fused.enable(model)
    try:
        with fused.forced():
            fast = run()
    finally:
        fused.enable(model, False)
    torch.testing.assert_close(fast, eager, atol=5e-2, rtol=5e-2)

    block = SparseMoeBlock(512, 32, 8, 256).to("cuda", torch.bfloat16)
    fill_dummy_weights(block, seed=4, std=0.05)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_usable(x, block.experts.gate_up_proj, block.experts.down_proj)
    with torch.no_grad():
        block.use_grouped = False
        loop = block(x)
        block.use_grouped, block.fused = True, True
        with fused.forced():
            grouped = block(x)
    torch.testing.assert_close(grouped, loop, atol=3e-2, rtol=3e-2)
