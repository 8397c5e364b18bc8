"""glimpse's Gemma 4 language model against transformers' ``Gemma4ForCausalLM`` (CPU, float32, tiny random models;
gemma4_harness.py): config parsing (Hub and saved forms, KV-sharing, refusals), logits of chunked prefills and greedy
decodes through paged caches of two shapes for (a) sliding + full layers with another global head dim and k_eq_v,
(b) KV-shared layers, (c) per-layer inputs, (d) the MoE block, (e) softcapped logits; a window shorter than the
prompt; image rows spliced into per-layer-input rows with in-image bidirectional sliding layers (transformers'
Gemma4Model path); loading; TP 2 over gloo; KV-shared and per-layer-input layers through emulated piecewise graphs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import Tensor

from tests.workers.engine.models.gemma4_harness import (
    VARIANTS,
    GemmaCache,
    MaskedSdpaBackend,
    greedy,
    hf_greedy,
    hf_logits,
    hub_config,
    hub_weights,
    load_ours,
    reference,
    text_config,
)
from tests.workers.engine.models.lm_harness import BLOCK_SIZE, run_tp_ranks
from workers.engine.kernels.attention import AttentionMetadata
from workers.engine.layers.linear import TPGroup
from workers.engine.models.base import LanguageModel
from workers.engine.models.gemma4.spec import FULL, SLIDING, TextSpec, check_tp
from workers.engine.models.loader import normalize_name
from workers.engine.runner.piecewise_graphs import PiecewiseGraphs

# Logits have |max| ~2-10 here; glimpse fuses q/k/v and gate/up into one matmul each, which rounds a few outputs
# differently in the last bit: measured max |diff| ~1e-5.
ATOL = 1e-4
NEW = 8
PLAN = [{"a": 5, "b": 9}, {"b": 10, "a": 16}, {"a": 7}, {"a": 9}]


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """One intra-op thread: these models are tiny, and thread fork/joins dominate on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompt(n: int, seed: int) -> Tensor:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))


def backends() -> list[str]:
    """Every numeric test runs on the model's own CPU backend (SdpaBackend) and on the harness's reference one."""
    return ["own", "reference"]


def backend_of(name: str) -> Any:
    return MaskedSdpaBackend() if name == "reference" else None


# ---- config ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_spec_reads_hub_and_saved_configs_alike(variant: str) -> None:
    """transformers saves ``per_layer_config``; Hub configs carry ``global_head_dim`` / ``num_global_key_value_heads``.
    Both give transformers' own per-layer shapes, and the KV sources follow its ``kv_sharing_modes``."""
    config = text_config(variant)
    saved = hub_config(config)
    hub = {**saved, "text_config": {k: v for k, v in saved["text_config"].items() if k != "per_layer_config"}}
    hub["text_config"].update(global_head_dim=16, num_global_key_value_heads=1)
    spec = TextSpec.from_hf_config(saved)
    assert TextSpec.from_hf_config(hub) == spec
    layers = range(config.num_hidden_layers)
    assert spec.layer_head_dims == tuple(config.per_layer_config[i].head_dim for i in layers)
    assert spec.layer_kv_heads == tuple(config.per_layer_config[i].num_key_value_heads for i in layers)
    modes = config.kv_sharing_modes
    assert [not spec.owns_kv(i) for i in layers] == [m == "reuse" for m in modes]
    sources = {spec.kv_sources[i] for i in layers if not spec.owns_kv(i)}
    assert all(modes[s] == "store" for s in sources)
    assert spec.kv_shapes() == tuple((spec.layer_kv_heads[i], spec.layer_head_dims[i]) for i in spec.kv_owner_layers)


def test_spec_fields_of_a_shared_ple_config() -> None:
    spec = TextSpec.from_hf_config(hub_config(text_config("ple", use_bidirectional_attention="vision")))
    # Layers 4 (sliding) and 5 (full) read layers 3 and 2; k_eq_v gives the full layers one KV head of dim 16.
    assert spec.kv_sources == (0, 1, 2, 3, 3, 2) and spec.kv_layers == 4
    assert spec.kv_shapes() == ((2, 8), (2, 8), (1, 16), (2, 8))
    assert [spec.cache_index(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert spec.token_row_width == 32 + 6 * 8 and spec.per_layer_width == 48
    assert spec.bidirectional_vision and spec.tie_word_embeddings
    assert [spec.window(i) for i in range(6)] == [64, 64, 0, 64, 64, 0]
    assert spec.full_rope.rope_type == "proportional" and spec.full_rope.partial_rotary_factor == 0.25
    # The proportional table: 2 of 8 frequencies rotate (exponents over the whole head dim), the rest stay.
    inv = spec.full_rope.inv_freq(16)
    assert inv.shape == (8,) and torch.equal(inv[2:], torch.zeros(6)) and inv[1] == 1e6 ** (-2 / 16)
    wide = TextSpec.from_hf_config(hub_config(text_config("shared")))
    assert [wide.mlp_width(i) for i in range(6)] == [48, 48, 48, 48, 96, 96]


def test_default_layer_types_and_last_layer_forced_full() -> None:
    spec = TextSpec.from_hf_config({"text_config": {"num_hidden_layers": 8, "num_attention_heads": 4}})
    assert spec.layer_types == (SLIDING,) * 5 + (FULL, SLIDING, FULL)
    assert spec.layer_head_dims == (256,) * 5 + (512, 256, 512)  # global_head_dim defaults to 512
    assert spec.layer_kv_heads == (4,) * 8  # num_global_key_value_heads only applies with attention_k_eq_v
    given = TextSpec.from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "layer_types": [SLIDING] * 2})
    assert given.layer_types == (SLIDING, FULL)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"use_bidirectional_attention": "all"}, NotImplementedError, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, NotImplementedError, "hidden_activation"),
        ({"attention_bias": True}, NotImplementedError, "attention_bias"),
        ({"num_kv_shared_layers": 6}, ValueError, "num_kv_shared_layers"),
        ({"rope_parameters": {SLIDING: {"rope_type": "yarn", "rope_theta": 1.0}, FULL: {"rope_type": "default",
          "rope_theta": 1.0}}}, NotImplementedError, "yarn"),
        ({"per_layer_config": {"2": {"head_dim": 16}, "5": {"head_dim": 32}}}, NotImplementedError, "head shapes"),
        ({"per_layer_config": {"2": {"sliding_window": 3}}}, NotImplementedError, "sliding_window"),
        ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8}, ValueError,
         "top_k_experts"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], error: type[Exception], match: str) -> None:
    cfg = hub_config(text_config("dense"))
    cfg["text_config"].update(change)
    with pytest.raises(error, match=match):
        TextSpec.from_hf_config(cfg)


def test_tp_sizes_are_checked() -> None:
    spec = TextSpec.from_hf_config(hub_config(text_config("moe")))
    check_tp(spec, 2)
    check_tp(spec, 4)  # 4 heads, 2 sliding KV heads and 1 global one replicated
    with pytest.raises(ValueError, match=r"num_attention_heads=4, moe_intermediate_size=16, sliding_attention KV heads=2"):
        check_tp(spec, 3)  # 48 splits in 3, and the one global KV head would be replicated


# ---- numerics ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request: pytest.FixtureRequest) -> tuple[str, Any, Any]:
    hf = reference(text_config(request.param))
    return request.param, hf, load_ours(hf)


@pytest.mark.parametrize("backend", backends())
def test_chunked_prefill_logits_equal_transformers(models: tuple[str, Any, Any], backend: str) -> None:
    variant, hf, ours = models
    ids = prompt(37, seed=1)
    cache = GemmaCache(ours, backend=backend_of(backend))
    chunked = torch.cat([cache.step([("a", ids[a:b])])[0] for a, b in ((0, 5), (5, 21), (21, 37))])
    expected = hf_logits(hf, ids)
    torch.testing.assert_close(chunked, expected, atol=ATOL, rtol=0)
    if variant == "dense":  # (e): the softcap bounds every logit, and transformers' are capped the same
        assert expected.abs().max() < 3.0


@pytest.mark.parametrize("backend", backends())
def test_shared_steps_decode_as_generate(models: tuple[str, Any, Any], backend: str) -> None:
    """Two sequences with different chunkings, one decoding while the other still prefills, then batched decodes:
    each one's tokens and the logits they were picked from equal transformers' generate."""
    _, hf, ours = models
    prompts = {"a": prompt(37, seed=3), "b": prompt(19, seed=4)}
    got = greedy(GemmaCache(ours, backend=backend_of(backend)), prompts, PLAN, NEW)
    for name, ids in prompts.items():
        tokens, logits = hf_greedy(hf, ids, NEW)
        assert got[name][0] == tokens, name
        torch.testing.assert_close(got[name][1], logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("variant", ["dense", "ple"])
def test_window_shorter_than_the_prompt(variant: str, backend: str) -> None:
    """sliding_window 8 over a 37-token prompt and its decodes: the sliding layers (own and KV-shared) see only the
    last 8 positions, as transformers' sliding caches and masks do."""
    hf = reference(text_config(variant, sliding_window=8))
    ours = load_ours(hf)
    ids = prompt(37, seed=5)
    cache = GemmaCache(ours, backend=backend_of(backend))
    chunked = torch.cat([cache.step([("a", ids[a:b])])[0] for a, b in ((0, 11), (11, 30), (30, 37))])
    torch.testing.assert_close(chunked, hf_logits(hf, ids), atol=ATOL, rtol=0)
    tokens, logits = hf_greedy(hf, ids, NEW)
    got = greedy(GemmaCache(ours, backend=backend_of(backend)), {"a": ids}, [{"a": 11}, {"a": 26}], NEW)["a"]
    assert got[0] == tokens
    torch.testing.assert_close(got[1], logits, atol=ATOL, rtol=0)


def test_token_rows_embed_image_pads_and_placeholders_as_pad() -> None:
    hf = reference(text_config("ple"))
    ours = load_ours(hf)
    emb = ours.embed_tokens
    placeholder = 100
    emb.placeholders = torch.tensor([placeholder])  # as an image_token_id inside the vocabulary would be
    ids = torch.tensor([5, 2**30 + 7, placeholder, 0])
    with torch.no_grad():
        rows = emb(ids)
        main = hf.model.embed_tokens(torch.tensor([5, 0]))
        per_layer = hf.model.embed_tokens_per_layer(torch.tensor([5, 0]))
    assert rows.shape == (4, 32 + 6 * 8)
    for i, want in enumerate([0, 1, 1, 1]):
        assert torch.equal(rows[i, :32], main[want]) and torch.equal(rows[i, 32:], per_layer[want])


@pytest.mark.parametrize("backend", backends())
def test_image_rows_with_per_layer_inputs_and_bidirectional_sliding_layers(backend: str) -> None:
    """transformers' Gemma4Model path for an image: the image positions embedded (and looked up for PLE) as pad, the
    features written over the main part, the per-layer inputs projected from those rows; sliding layers let the
    image's tokens see each other (window 8 < the prompt), full layers stay causal. Chunks never cut the image."""
    from transformers.models.gemma4.modeling_gemma4 import create_masks_for_vision_model

    config = text_config("ple", use_bidirectional_attention="vision", sliding_window=8)
    hf = reference(config)
    ours = load_ours(hf)
    n, lo, hi = 30, 6, 15
    ids = prompt(n, seed=6)
    features = torch.randn(hi - lo, 32, generator=torch.Generator().manual_seed(7))
    text_ids = ids.clone()
    text_ids[lo:hi] = config.pad_token_id
    model = hf.model
    expected = {}
    with torch.no_grad():
        embeds = model.embed_tokens(text_ids[None]).clone()
        embeds[0, lo:hi] = features
        per_layer = model.get_per_layer_inputs(text_ids[None], None)
        positions = torch.arange(n)[None]
        for name, group in (("bidirectional", 0), ("causal", -1)):
            blocks = torch.full((1, n), -1)
            blocks[0, lo:hi] = group
            masks = create_masks_for_vision_model(config, embeds, None, None, positions, blocks)
            hidden = model(inputs_embeds=embeds, per_layer_inputs=per_layer, attention_mask=masks,
                           position_ids=positions, output_hidden_states=True).last_hidden_state
            expected[name] = hf.lm_head(hidden)[0]
    assert (expected["bidirectional"] - expected["causal"]).abs().max() > 0.1  # the spans matter here
    pads = ids.clone()
    pads[lo:hi] = 2**30 + torch.arange(hi - lo)  # glimpse's image pad values
    with torch.no_grad():
        rows = ours.embed_tokens(pads)
    rows[lo:hi, :32] = features  # what VLModel.splice writes
    cache = GemmaCache(ours, backend=backend_of(backend))
    got = [cache.step([("a", pads[a:b])], rows={"a": rows}, spans={"a": [(lo, hi)]})[0]
           for a, b in ((0, 6), (6, 20), (20, 30))]
    torch.testing.assert_close(torch.cat(got), expected["bidirectional"], atol=ATOL, rtol=0)


# ---- loading -----------------------------------------------------------------------------------------------------
def test_loading_skips_what_transformers_ignores_and_names_what_is_missing() -> None:
    hf = reference(text_config("ple"))
    weights = {normalize_name(n): t for n, t in hub_weights(hf).items()}
    ours = load_ours(hf)
    # A KV-shared layer's stray K/V weights and a tied head's copy are skipped (transformers ignores them too).
    extra = {"lm.layers.4.self_attn.k_proj.weight": torch.zeros(16, 32), "lm.lm_head.weight": torch.zeros(128, 32)}
    assert not ours.load_weights(extra.items(), partial=True)
    assert not any(".4.self_attn.k_norm" in n for n, _ in ours.named_parameters())
    with pytest.raises(KeyError, match="no 'v' projection"):  # k_eq_v: a full layer has no v_proj
        ours.load_weights([("lm.layers.2.self_attn.v_proj.weight", torch.zeros(16, 32))], partial=True)
    with pytest.raises(KeyError, match="mystery"):
        ours.load_weights([("lm.layers.0.mystery.weight", torch.zeros(1))], partial=True)
    fresh = load_ours(hf)
    fresh._loaded.clear()
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight"):
        fresh.load_weights((n, t) for n, t in weights.items() if n != "lm.layers.1.self_attn.k_proj.weight")
    fresh._loaded.clear()
    with pytest.raises(ValueError, match=r"embed_tokens\.per_layer\.weight"):
        fresh.load_weights((n, t) for n, t in weights.items() if "embed_tokens_per_layer" not in n)


def test_tp_shards_and_cache_shapes() -> None:
    """Rank 1 of 2 (no communication needed to load): query and sliding KV heads split, the one global KV head
    replicated, the experts' intermediate dim halved, the small PLE and router weights whole."""
    hf = reference(text_config("moe", hidden_size_per_layer_input=8, vocab_size_per_layer_input=128))
    ours = load_ours(hf, TPGroup(rank=1, size=2))
    w = {normalize_name(n): t for n, t in hub_weights(hf).items()}
    p = dict(ours.named_parameters())
    q = w["lm.layers.2.self_attn.q_proj.weight"]  # 4 heads of 16
    k = w["lm.layers.2.self_attn.k_proj.weight"]  # 1 head of 16: replicated
    assert torch.equal(p["layers.2.self_attn.qkv_proj.weight"], torch.cat([q[32:], k]))
    k0 = w["lm.layers.0.self_attn.k_proj.weight"]  # 2 heads of 8: the second
    assert torch.equal(p["layers.0.self_attn.qkv_proj.weight"][16:24], k0[8:])
    gate_up = w["lm.layers.0.experts.gate_up_proj"]  # [4, 32, 32]: gate rows then up rows, 16 each
    assert torch.equal(p["layers.0.experts.gate_up_proj"], torch.cat([gate_up[:, 8:16], gate_up[:, 24:]], dim=1))
    assert torch.equal(p["layers.0.experts.down_proj"], w["lm.layers.0.experts.down_proj"][:, :, 8:])
    assert torch.equal(p["layers.0.router.proj.weight"], w["lm.layers.0.router.proj.weight"])
    assert torch.equal(p["embed_tokens.per_layer.weight"], w["lm.embed_tokens_per_layer.weight"][64:])
    assert ours.kv_cache_shapes(5, 4) == [(2, 5, 4, 1, 8), (2, 5, 4, 1, 8), (2, 5, 4, 1, 16), (2, 5, 4, 1, 8),
                                          (2, 5, 4, 1, 8), (2, 5, 4, 1, 16)]
    assert ours.kv_cache_shape(5, 4) == (2, 5, 4, 1, 8)


PROMPTS = {"a": prompt(37, seed=8), "b": prompt(19, seed=9)}
TP_VARIANTS = [("moe", {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128}), ("shared", {})]


def _scenario(tp: TPGroup) -> list[dict[str, tuple[list[int], Tensor]]]:
    out = []
    for variant, extra in TP_VARIANTS:
        ours = load_ours(reference(text_config(variant, **extra)), tp)
        out.append(greedy(GemmaCache(ours, backend=MaskedSdpaBackend()), PROMPTS, PLAN, 6))
    return out


def _tp_run(tp: TPGroup) -> list[dict[str, tuple[list[int], Tensor]]]:
    torch.set_num_threads(1)
    return _scenario(tp)


def test_tp2_over_gloo_answers_as_tp1(tmp_path: Path) -> None:
    """Two real ranks (all-reduces after o_proj, the MLPs and the experts; vocab-parallel embeddings of both tables;
    gathered logits): the same greedy tokens as one rank, and logits within rounding."""
    expected = _scenario(TPGroup())
    for rank_result in run_tp_ranks(_tp_run, 2, tmp_path):
        for got, want in zip(rank_result, expected, strict=True):
            for name in PROMPTS:
                assert got[name][0] == want[name][0]
                torch.testing.assert_close(got[name][1], want[name][1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["shared", "ple"])
def test_kv_shared_and_per_layer_input_layers_in_piecewise_graphs(variant: str) -> None:
    """The E models' layers between emulated pieces: KV-shared layers attend over their store layer's cache with no
    K/V of their own, and the per-layer inputs ride in the input rows' extra columns. Steps of up to 16 tokens take
    the pieces (K/V written there, padding rows into a spare block), larger ones the eager forward; the greedy
    tokens and their logits are the eager model's."""
    hf = reference(text_config(variant))
    ours = load_ours(hf)
    prompts = {"a": prompt(37, seed=3), "b": prompt(19, seed=4)}
    eager = greedy(GemmaCache(ours), prompts, PLAN, NEW)
    cache = GemmaCache(ours)
    spare = cache.free.pop()  # a block no sequence is given: the padding rows' K/V go there
    width = ours.embed_tokens(torch.zeros(1, dtype=torch.int64)).shape[-1]
    lm = cast(LanguageModel, ours)  # the runner's view of a family's LM
    pieces = PiecewiseGraphs(lm, ours.attention_backend(torch.device("cpu")), cache.caches, width, 16, torch.float32,
                             scratch_slot=spare * BLOCK_SIZE, emulate=True)

    def forward(embeds: Tensor, positions: Tensor, caches: list[Tensor], meta: AttentionMetadata, backend: Any) -> Tensor:
        hidden = pieces.run(embeds, positions, meta)
        return hidden if hidden is not None else ours(embeds, positions, caches, meta, backend)

    cache.forward = forward
    got = greedy(cache, prompts, PLAN, NEW)
    for name in prompts:
        assert got[name][0] == eager[name][0], name
        torch.testing.assert_close(got[name][1], eager[name][1], atol=ATOL, rtol=0)
    assert pieces.stats["replays"] > 0 and pieces.stats["misses"] > 0
    assert width > ours.spec.hidden_size if variant == "ple" else width == ours.spec.hidden_size
    assert len(pieces.layers) == ours.spec.num_hidden_layers
    assert sum(not call.own_kv for call in pieces.layers) == 2  # the two KV-shared layers read their store's cache
