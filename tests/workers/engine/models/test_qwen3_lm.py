"""glimpse's Qwen3-VL language model, dense and MoE, against transformers on tiny random checkpoints
(CPU, float32), and its fused CUDA kernels against eager (bf16). The expert kernels alone: test_qwen3_moe_kernels.py."""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from workers.engine.kernels import fused
from workers.engine.kernels.attention import build_attention_metadata
from workers.engine.layers.linear import SINGLE_RANK, TPGroup
from workers.engine.models.loader import fill_dummy_weights, normalize_name
from workers.engine.models.qwen3_vl.lm import (
    Qwen3VLLanguageModel,
    RotaryTables,
    TextSpec,
    build_language_model,
    mrope_rows,
)
from workers.engine.models.qwen3_vl.moe import SparseMoeBlock, grouped_mm_usable

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 48
HIDDEN = 64
LEVELS = 2  # DeepStack levels: added after decoder layers 0 and 1 (of 3)
TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
        "rope_theta": 10000.0,
    },
}
# 2I = 96 != H = 64, so the Hub's [E, H, 2I] and transformers' [E, 2I, H] expert layouts can be told apart.
MOE_TEXT_CONFIG: dict[str, Any] = {
    **TEXT_CONFIG,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],  # layers 0 and 2 sparse, layer 1 dense
}
VISION_CONFIG: dict[str, Any] = dict(
    depth=1,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=HIDDEN,
    deepstack_visual_indexes=[0],
)
FORMATS = ["dense", "moe_saved", "moe_hub", "moe_per_expert"]


def _randomize(hf: Any) -> None:
    # Default init leaves norms at 1; draw every weight so loading each one is actually checked.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.05
            p.copy_(1.0 + 2 * noise if "norm" in name else noise)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """kind ("dense", "moe") -> (directory written by transformers' save_pretrained, the model itself)."""
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    out = {}
    for kind in ("dense", "moe"):
        torch.manual_seed(0)
        hf: Any
        if kind == "dense":
            hf = Qwen3VLForConditionalGeneration(
                Qwen3VLConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG)
            )
        else:
            cfg = Qwen3VLMoeConfig(text_config=MOE_TEXT_CONFIG, vision_config=VISION_CONFIG)
            hf = Qwen3VLMoeForConditionalGeneration(cfg)
        hf = hf.float().eval()
        _randomize(hf)
        path = tmp_path_factory.mktemp(f"tiny_qwen3_vl_{kind}")
        hf.save_pretrained(path)
        out[kind] = (path, hf)
    return out


def _expert_variant(src: Path, dst: Path, fmt: str) -> Path:
    """Rewrite the saved MoE checkpoint's experts as the Hub stores them, or split per expert."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[name] = t
        elif fmt == "moe_hub":  # x @ W layout: gate_up [E, H, 2I], down [E, I, H]
            out[name] = t.transpose(1, 2).contiguous()
        elif name.endswith("gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                out[f"{base}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{base}{e}.up_proj.weight"] = up.contiguous()
        else:
            base = name[: -len("down_proj")]
            for e, w in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = w.contiguous()
    save_file(out, dst / "model.safetensors")
    return dst


def checkpoint_dir(saved: dict[str, tuple[Path, Any]], fmt: str, tmp: Path) -> tuple[Path, Any]:
    if fmt == "dense":
        return saved["dense"]
    path, hf = saved["moe"]
    return (path, hf) if fmt == "moe_saved" else (_expert_variant(path, tmp / fmt, fmt), hf)


def load_ours(path: Path, tp: TPGroup = SINGLE_RANK) -> Qwen3VLLanguageModel:
    spec = TextSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    model = build_language_model(spec, tp=tp, dtype=torch.float32, device="cpu", attn_backend="sdpa")
    tensors: dict[str, Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    model.load_weights((normalize_name(n), t) for n, t in tensors.items())
    return model


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
    num_blocks: int = NUM_BLOCKS
    caches: list[Tensor] = field(init=False)
    free: list[int] = field(init=False)
    tables: dict[str, list[int]] = field(default_factory=dict)
    done: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        shape = self.model.kv_cache_shape(self.num_blocks, BLOCK_SIZE)
        self.caches = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.model.layers]
        self.free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free)

    def step(self, chunks: list[tuple[str, int]], seqs: dict[str, Seq]) -> list[Tensor]:
        """One flattened forward over ``(seq, n_new_tokens)`` chunks; returns each chunk's final hidden."""
        q_lens, s_lens, tables, ids, pos, rows, feats = [], [], [], [], [], [], []
        offset = 0
        for name, n in chunks:
            seq, start = seqs[name], self.done.get(name, 0)
            table = self.tables.setdefault(name, [])
            while len(table) * BLOCK_SIZE < start + n:
                table.append(self.free.pop())
            q_lens.append(n)
            s_lens.append(start + n)
            tables.append(table)
            ids.append(seq.ids[start : start + n])
            pos.append(seq.positions[:, start : start + n])
            inside = (seq.image_rows >= start) & (seq.image_rows < start + n)
            rows.append(seq.image_rows[inside] - start + offset)  # this chunk's image rows, as batch rows
            feats.append(seq.features[inside])
            self.done[name] = start + n
            offset += n
        dev = self.device
        meta = build_attention_metadata(q_lens, s_lens, tables, BLOCK_SIZE, device=dev)
        batch_rows = torch.cat(rows).to(dev)
        feat = torch.cat(feats).to(dev, self.dtype)
        deepstack = (batch_rows, feat) if batch_rows.numel() else None
        with torch.no_grad():
            embeds = self.model.embed_tokens(torch.cat(ids).to(dev))
            hidden = self.model(embeds, torch.cat(pos, dim=1).to(dev), self.caches, meta, deepstack=deepstack)
        return list(hidden.split(q_lens))


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


# ---------------------------------------------------------------- config


def test_text_spec_reads_every_layout(saved: dict[str, tuple[Path, Any]]) -> None:
    dense = TextSpec.from_hf_config(json.loads((saved["dense"][0] / "config.json").read_text()))
    assert dense.mrope_section == (2, 3, 3) and dense.mrope_interleaved and dense.num_experts == 0
    assert dense.head_dim == 16 and dense.rope_theta == 10000.0 and not dense.tie_word_embeddings
    # Original layout: text fields at top level, rope_scaling + rope_theta.
    text = {k: v for k, v in TEXT_CONFIG.items() if k != "rope_parameters"}
    rope = dict(TEXT_CONFIG["rope_parameters"])
    old = {**text, "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    assert TextSpec.from_hf_config(old) == TextSpec.from_hf_config({"text_config": TEXT_CONFIG})
    assert dense == TextSpec.from_hf_config({"text_config": TEXT_CONFIG, "tie_word_embeddings": False})

    moe_cfg = json.loads((saved["moe"][0] / "config.json").read_text())
    assert (
        moe_cfg["text_config"]["num_local_experts"] == 8
    )  # transformers 5 writes num_experts under this name
    # ... and a text_config tie flag of true that the root (false) overrides: the root decides, as there.
    assert moe_cfg["text_config"]["tie_word_embeddings"] and not moe_cfg["tie_word_embeddings"]
    moe = TextSpec.from_hf_config(moe_cfg)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 48)
    assert not moe.tie_word_embeddings
    assert [moe.layer_is_sparse(i) for i in range(3)] == [True, False, True]
    step2 = TextSpec.from_hf_config(
        {"text_config": {**MOE_TEXT_CONFIG, "decoder_sparse_step": 2, "mlp_only_layers": []}}
    )
    assert [step2.layer_is_sparse(i) for i in range(3)] == [False, True, False]
    assert TextSpec.from_hf_config(
        {"text_config": TEXT_CONFIG, "tie_word_embeddings": True}
    ).tie_word_embeddings
    assert TextSpec.from_hf_config(
        {"text_config": {**TEXT_CONFIG, "tie_word_embeddings": True}}
    ).tie_word_embeddings

    bad_configs: list[dict[str, Any]] = [
        {"rope_parameters": {**rope, "rope_type": "yarn", "rope_theta": 1.0}},
        {"hidden_act": "gelu"},
        {"use_sliding_window": True},
    ]
    for bad in bad_configs:
        with pytest.raises(NotImplementedError):
            TextSpec.from_hf_config({"text_config": {**TEXT_CONFIG, **bad}})
    with pytest.raises(NotImplementedError, match="norm_topk_prob"):
        TextSpec.from_hf_config({"text_config": {**MOE_TEXT_CONFIG, "norm_topk_prob": False}})
    with pytest.raises(ValueError, match="mrope_section"):
        TextSpec.from_hf_config(
            {
                "text_config": {
                    **TEXT_CONFIG,
                    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 2, 2]},
                }
            }
        )


def test_interleaved_rotary_tables_equal_transformers(saved: dict[str, tuple[Path, Any]]) -> None:
    _, hf = saved["dense"]
    assert mrope_rows((2, 3, 3), True) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert mrope_rows((24, 20, 20), True)[57:] == [0, 1, 2, 0, 0, 0, 0]  # h, w stop at 3*20; t keeps 60..63
    assert mrope_rows((2, 3, 3), False) == [0, 0, 1, 1, 1, 2, 2, 2]
    positions = torch.randint(0, 5000, (3, 37))
    rotary = RotaryTables(16, 10000.0, mrope_rows((2, 3, 3), True))
    cos, sin_signed = rotary(positions, torch.float32)
    ref_cos, ref_sin = hf.model.language_model.rotary_emb(torch.zeros(1), positions[:, None])
    assert torch.equal(cos[:, 0], ref_cos[0]) and torch.equal(sin_signed[:, 0, 8:], ref_sin[0, :, 8:])
    assert torch.equal(sin_signed[:, 0, :8], -ref_sin[0, :, :8])


# ---------------------------------------------------------------- against transformers


@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_multimodal_batches_match_transformers(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, fmt: str
) -> None:
    """Chunked prefill with DeepStack rows split across chunks and batch positions, then decodes."""
    path, hf = checkpoint_dir(saved, fmt, tmp_path)
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


def test_transformers_saves_experts_in_its_in_memory_layout(saved: dict[str, tuple[Path, Any]]) -> None:
    """What save_pretrained writes (transformers 5.24): [E, 2I, H] / [E, H, I], not the Hub's transpose."""
    tensors = load_file(saved["moe"][0] / "model.safetensors")
    assert tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 96, 64)
    assert tensors["model.language_model.layers.0.mlp.experts.down_proj"].shape == (8, 64, 48)


def test_missing_or_malformed_expert_weights_are_named(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    path = _expert_variant(saved["moe"][0], tmp_path / "split", "moe_per_expert")
    tensors = load_file(path / "model.safetensors")
    victim = "model.language_model.layers.2.mlp.experts.5.up_proj.weight"
    del tensors[victim]
    spec = TextSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    model = build_language_model(spec, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts\.gate_up_proj"):
        model.load_weights((normalize_name(n), t) for n, t in tensors.items())
    bad = torch.zeros(8, 64, 64)  # fits neither [E, 2I, H] nor [E, H, 2I]
    with pytest.raises(ValueError, match="neither"):
        model.load_weights([("lm.layers.0.mlp.experts.gate_up_proj", bad)], partial=True)


def test_partial_loads_then_check(saved: dict[str, tuple[Path, Any]]) -> None:
    """The shape of the runner's streaming load: several partial calls, then one completeness check."""
    path, _ = saved["moe"]
    spec = TextSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    model = build_language_model(spec, dtype=torch.float32, device="cpu")
    items = [(normalize_name(n), t) for n, t in load_file(path / "model.safetensors").items()]
    model.load_weights(items[::2], partial=True)
    with pytest.raises(ValueError, match="lacks"):
        model.check_loaded()
    model.load_weights(items[1::2], partial=True)
    model.check_loaded()


def test_tied_embeddings_share_one_weight(saved: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    path, _ = saved["dense"]
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if k != "lm_head.weight"}
    save_file(tensors, tmp_path / "model.safetensors")
    tied = load_ours(tmp_path)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    h = torch.randn(3, HIDDEN)
    torch.testing.assert_close(
        tied.compute_logits(h), h @ tensors["model.language_model.embed_tokens.weight"].T
    )


# ---------------------------------------------------------------- tensor parallelism (gloo, CPU)


def _tp_worker(rank: int, world: int, port: int, dirs: dict[str, str], out: str) -> None:
    """One TP rank: load each checkpoint's shards, run the scenario, save the hidden states."""
    import faulthandler

    import torch.distributed as dist

    err = open(Path(out) / f"rank{rank}.stderr", "w")  # noqa: SIM115 - lives as long as the process
    os.dup2(err.fileno(), 2)
    faulthandler.enable(err)
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        tp = TPGroup(rank=rank, size=world, group=dist.group.WORLD)
        results = {fmt: run_scenario(load_ours(Path(d), tp)) for fmt, d in dirs.items()}
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.barrier()  # nobody tears down while a peer still talks
    finally:
        dist.destroy_process_group()
    # Done and saved: skip the interpreter's teardown, where gloo's threads once aborted a rank ("terminate called
    # without an active exception") after every rank had saved its result (a CI run, session 18).
    err.flush()
    os._exit(0)


def test_tensor_parallel_over_gloo_matches_transformers(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """TP=2 (one KV head per rank; every expert's intermediate dim halved) for dense and both MoE layouts."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    dirs = {
        fmt: str(checkpoint_dir(saved, fmt, tmp_path)[0]) for fmt in ("dense", "moe_hub", "moe_per_expert")
    }
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        mp.spawn(_tp_worker, args=(2, int(store.port), dirs, str(tmp_path)), nprocs=2, join=True)
    except Exception:
        for log in sorted(tmp_path.glob("rank*.stderr")):
            print(f"--- {log.name}\n{log.read_text()}")
        raise
    seqs = scenario_seqs()
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for fmt in dirs:
            hf = saved["dense" if fmt == "dense" else "moe"][1]
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
