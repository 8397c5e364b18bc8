"""glimpse's Qwen2.5-VL language model against transformers on a tiny random checkpoint (CPU, float32), and over
real tensor-parallel ranks. The parallel layers' shards alone: tests/workers/engine/layers/test_linear.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.workers.engine.models.lm_harness import PagedCache, run_tp_ranks
from workers.engine.layers.linear import TPGroup
from workers.engine.models.loader import normalize_name
from workers.engine.models.qwen2_5_vl.lm import Qwen2_5_VLLanguageModel, TextSpec, load_language_model

ATOL = 1e-4
NUM_BLOCKS = 40
TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    "initializer_range": 0.05,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
VISION_CONFIG: dict[str, Any] = dict(
    depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, fullatt_block_indexes=[0]
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A saved tiny Qwen2.5-VL and the transformers model it came from (float32, eval)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG)
    hf = Qwen2_5_VLForConditionalGeneration(config).float().eval()
    # Default init leaves biases at 0 and norms at 1; randomize them so loading them is actually checked.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.05
            p.copy_(1.0 + 2 * noise if "norm" in name else noise)
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def model(checkpoint: tuple[Path, Any]) -> Qwen2_5_VLLanguageModel:
    path, _ = checkpoint
    spec = TextSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    return load_language_model(path, spec, dtype=torch.float32, device="cpu", attn_backend="sdpa")


def hf_logits(hf: Any, embeds: Tensor, positions: Tensor) -> Tensor:
    """transformers' logits for one whole sequence: embeds [T, H], positions [3, T]."""
    with torch.no_grad():
        out = hf.model.language_model(
            inputs_embeds=embeds[None], position_ids=positions[:, None, :], use_cache=False
        )
        return hf.lm_head(out.last_hidden_state)[0].float()


def make_positions(n: int, distinct: bool) -> Tensor:
    """[3, n] M-RoPE positions; ``distinct`` gives t/h/w rows that differ, as inside an image span."""
    t = torch.arange(n)
    if not distinct:
        return t.expand(3, -1).clone()
    return torch.stack([t // 3, t + (t % 4) * 5, (t * 7) % 11 + t // 2])


@dataclass
class PagedRunner:
    """Drives our model step by step through a paged cache whose blocks are handed out in shuffled order."""

    model: Qwen2_5_VLLanguageModel
    seed: int = 0

    def __post_init__(self) -> None:
        self.cache = PagedCache(self.model, self.seed, NUM_BLOCKS)

    @property
    def tables(self) -> dict[str, list[int]]:
        return self.cache.tables

    def step(
        self, chunks: list[tuple[str, int]], embeds: dict[str, Tensor], positions: dict[str, Tensor]
    ) -> list[Tensor]:
        """Run one flattened forward over ``(seq, n_new_tokens)`` chunks; return each chunk's logits."""
        meta, starts = self.cache.schedule(chunks)
        parts_e = [embeds[seq][start : start + n] for (seq, n), start in zip(chunks, starts, strict=True)]
        parts_p = [positions[seq][:, start : start + n] for (seq, n), start in zip(chunks, starts, strict=True)]
        with torch.no_grad():
            hidden = self.model(torch.cat(parts_e), torch.cat(parts_p, dim=1), self.cache.caches, meta)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([n for _, n in chunks]))


def random_sequence(model: Qwen2_5_VLLanguageModel, n: int, seed: int) -> Tensor:
    ids = torch.randint(0, model.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        embeds: Tensor = model.embed_tokens(ids)
    return embeds


@pytest.mark.parametrize("distinct", [False, True], ids=["text_positions", "mrope_positions"])
def test_full_prefill_matches_transformers(
    checkpoint: tuple[Path, Any], model: Qwen2_5_VLLanguageModel, distinct: bool
) -> None:
    _, hf = checkpoint
    embeds = random_sequence(model, 19, seed=0)
    positions = make_positions(19, distinct)
    expected = hf_logits(hf, embeds, positions)
    (got,) = PagedRunner(model).step([("a", 19)], {"a": embeds}, {"a": positions})
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # The embedding itself must be transformers' too.
    ids = torch.arange(10)
    torch.testing.assert_close(model.embed_tokens(ids), hf.model.language_model.embed_tokens(ids))


@pytest.mark.parametrize("distinct", [False, True], ids=["text_positions", "mrope_positions"])
def test_chunked_prefill_then_decode_through_shuffled_blocks(
    checkpoint: tuple[Path, Any], model: Qwen2_5_VLLanguageModel, distinct: bool
) -> None:
    _, hf = checkpoint
    n = 20
    embeds = random_sequence(model, n, seed=1)
    positions = make_positions(n, distinct)
    expected = hf_logits(hf, embeds, positions)
    runner = PagedRunner(model, seed=3)
    got = []
    for chunk in [5, 7] + [1] * (n - 12):
        got += runner.step([("a", chunk)], {"a": embeds}, {"a": positions})
    table = runner.tables["a"]
    assert table != sorted(table), "the test wants a non-contiguous block table"
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_mixed_batch_of_decode_and_prefill_chunks(
    checkpoint: tuple[Path, Any], model: Qwen2_5_VLLanguageModel
) -> None:
    _, hf = checkpoint
    lengths = {"a": 10, "b": 11, "c": 13}
    embeds = {s: random_sequence(model, n, seed=10 + i) for i, (s, n) in enumerate(lengths.items())}
    positions = {s: make_positions(n, distinct=s != "b") for s, n in lengths.items()}
    expected = {s: hf_logits(hf, embeds[s], positions[s]) for s in lengths}
    runner = PagedRunner(model, seed=7)
    plan = [
        [("a", 9), ("c", 5)],  # two prefills, one of them a first chunk
        [("a", 1), ("b", 6), ("c", 7)],  # a decode, a fresh prefill chunk, a continuation chunk
        [("b", 5), ("c", 1)],  # a last chunk and a decode
    ]
    got: dict[str, list[Tensor]] = {s: [] for s in lengths}
    for chunks in plan:
        for (seq, _), logits in zip(chunks, runner.step(chunks, embeds, positions), strict=True):
            got[seq].append(logits)
    for seq, n in lengths.items():
        torch.testing.assert_close(torch.cat(got[seq]), expected[seq][:n], atol=ATOL, rtol=0)


def test_text_spec_reads_both_config_layouts(checkpoint: tuple[Path, Any]) -> None:
    path, _ = checkpoint
    new = TextSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    text = dict(TEXT_CONFIG)
    rope = text.pop("rope_parameters")
    # Original Qwen layout: text fields at top level, rope_scaling of type "mrope" plus rope_theta.
    old_cfg = {
        **text,
        "rope_theta": rope["rope_theta"],
        "vision_config": VISION_CONFIG,
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
    }
    assert TextSpec.from_hf_config(old_cfg) == new
    assert new.mrope_section == (2, 3, 3) and new.head_dim == 16 and not new.tie_word_embeddings
    assert TextSpec.from_hf_config({**old_cfg, "tie_word_embeddings": True}).tie_word_embeddings
    assert TextSpec.from_hf_config(
        {"text_config": {**TEXT_CONFIG, "tie_word_embeddings": True}}
    ).tie_word_embeddings


def test_tied_embeddings_share_one_weight(tmp_path: Path, checkpoint: tuple[Path, Any]) -> None:
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if k != "lm_head.weight"}
    save_file(tensors, tmp_path / "model.safetensors")
    spec = TextSpec.from_hf_config(cfg)
    tied = load_language_model(tmp_path, spec, dtype=torch.float32, device="cpu")
    assert tied.lm_head.weight is tied.embed_tokens.weight
    h = torch.randn(3, spec.hidden_size)
    torch.testing.assert_close(tied.compute_logits(h), h @ tensors["model.embed_tokens.weight"].T)


def test_loader_reads_sharded_checkpoints_in_either_naming(
    tmp_path: Path, checkpoint: tuple[Path, Any], model: Qwen2_5_VLLanguageModel
) -> None:
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint
    # transformers 5 module names (model.language_model.*, model.visual.*) over two indexed shards.
    renamed = {
        ("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)): v
        for k, v in load_file(path / "model.safetensors").items()
    }
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: renamed[k] for k in keys}, tmp_path / fname)
    weight_map = {k: fname for fname, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_language_model(tmp_path, model.spec, dtype=torch.float32, device="cpu")
    for (name, p), q in zip(loaded.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    for stored, canonical in [
        ("model.language_model.layers.0.mlp.up_proj.weight", "lm.layers.0.mlp.up_proj.weight"),
        ("model.layers.0.mlp.up_proj.weight", "lm.layers.0.mlp.up_proj.weight"),
        ("model.visual.blocks.0.attn.qkv.bias", "visual.blocks.0.attn.qkv.bias"),
        ("visual.merger.mlp.0.weight", "visual.merger.mlp.0.weight"),
        ("lm_head.weight", "lm.lm_head.weight"),
    ]:
        assert normalize_name(stored) == canonical
    # A missing projection is an error, not silently uninitialized memory.
    victim = "model.language_model.layers.2.self_attn.v_proj.weight"
    keep = [k for k in shards[weight_map[victim]] if k != victim]
    save_file({k: renamed[k] for k in keep}, tmp_path / weight_map[victim])
    with pytest.raises(ValueError, match="lacks"):
        load_language_model(tmp_path, model.spec, dtype=torch.float32, device="cpu")


def test_dummy_load_needs_no_weights(tmp_path: Path) -> None:
    cfg = {"text_config": {**TEXT_CONFIG, "num_hidden_layers": 2}, "vision_config": VISION_CONFIG}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = TextSpec.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    m1 = load_language_model(tmp_path, spec, dtype=torch.float32, device="cpu", load_format="dummy")
    m2 = load_language_model(tmp_path, spec, dtype=torch.float32, device="cpu", load_format="dummy")
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters(), strict=True):
        assert torch.equal(p1, p2), f"dummy weights are not deterministic: {name}"
    assert torch.all(m1.norm.weight == 1.0) and 0.01 < float(m1.embed_tokens.weight.std()) < 0.03
    runner = PagedRunner(m1)
    embeds = random_sequence(m1, 6, seed=0)
    (logits,) = runner.step([("a", 6)], {"a": embeds}, {"a": make_positions(6, True)})
    assert logits.shape == (6, spec.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert list(tmp_path.glob("*.safetensors")) == []


# ---------------------------------------------------------------- tensor parallelism


def _tp_run(tp: TPGroup, ckpt: str) -> Tensor:
    """One rank: load its shards, run prefill chunks + decodes."""
    spec = TextSpec.from_hf_config(json.loads((Path(ckpt) / "config.json").read_text()))
    m = load_language_model(Path(ckpt), spec, dtype=torch.float32, device="cpu", tp=tp, attn_backend="sdpa")
    return _tp_scenario(m)


def _tp_scenario(m: Qwen2_5_VLLanguageModel) -> Tensor:
    ids = torch.randint(0, m.spec.vocab_size, (14,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        embeds = m.embed_tokens(ids)  # exercises the vocab-parallel lookup + all-reduce
    positions = make_positions(14, distinct=True)
    runner = PagedRunner(m, seed=11)
    steps = [runner.step([("a", n)], {"a": embeds}, {"a": positions}) for n in (6, 5, 1, 1, 1)]
    return torch.cat([s[0] for s in steps])


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_forward_over_gloo_matches_single_rank(
    tmp_path: Path, checkpoint: tuple[Path, Any], model: Qwen2_5_VLLanguageModel, tp_size: int
) -> None:
    """Real TP: tp_size processes on CPU (gloo); tp=4 with 2 KV heads exercises KV replication."""
    path, _ = checkpoint
    results = run_tp_ranks(_tp_run, tp_size, tmp_path, str(path))
    expected = _tp_scenario(model)
    for got in results:
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
