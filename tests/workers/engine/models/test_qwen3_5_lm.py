"""glimpse's Qwen3.5 language model, dense and MoE, against transformers on the demo checkpoints (CPU, float32): the
logits of a whole prompt (text, and M-RoPE rows of an image span); greedy tokens equal to transformers' generate with
the prompt prefilled in chunks through the state pools, with two sequences sharing steps (mixed prefill and decode
batches), and with a prefix resumed from a state snapshot copied into a fresh slot. The pools themselves: shapes,
binding, and that a lost state changes the answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.workers.engine.models.qwen3_5_harness import (  # noqa: F401 (single_thread: an autouse fixture)
    HybridCache,
    greedy,
    hf_greedy,
    load_ours,
    load_reference,
    single_thread,
)
from workers.engine.kernels.attention import build_attention_metadata
from workers.engine.models.base import VLModel
from workers.engine.models.qwen3_5.lm import LinearDecoderLayer, Qwen3_5LanguageModel

# Logits have std ~8 (|max| ~35). glimpse's fused input projection and transformers' separate ones round the narrow
# b / a projections differently in the last bit (BLAS takes another path for 4 output columns), and the layers carry
# that on: measured max |diff| ~1.3e-4 on text prompts, ~6.5e-4 with image and video rows (test_qwen3_5_vision.py).
ATOL = 1e-3
NEW = 8
VOCAB_TEXT = 2000  # the demo tokenizer's BPE ids (special and tool tokens come after)


@pytest.fixture(scope="module", params=["dense", "moe"])
def models(request: pytest.FixtureRequest) -> tuple[Path, VLModel, Any]:
    model_dir: Path = request.getfixturevalue("qwen3_5_moe_model_dir" if request.param == "moe" else "qwen3_5_model_dir")
    return model_dir, load_ours(model_dir), load_reference(model_dir)


def prompt(n: int, seed: int) -> Tensor:
    return torch.randint(0, VOCAB_TEXT, (n,), generator=torch.Generator().manual_seed(seed))


def image_positions(n: int, start: int, h: int, w: int) -> Tensor:
    """[3, n] M-RoPE rows of a prompt with an h x w image span at ``start`` (as mrope_positions lays one out)."""
    i = torch.arange(h * w)
    span = torch.stack([torch.full((h * w,), start), start + i // w, start + i % w])
    after = torch.arange(n - start - h * w) + start + max(h, w)
    return torch.cat([torch.arange(start).expand(3, -1), span, after.expand(3, -1)], dim=1)


def hf_logits(hf: Any, ids: Tensor, positions: Tensor | None = None) -> Tensor:
    with torch.no_grad():
        if positions is None:
            return hf(input_ids=ids[None]).logits[0]
        lm = hf.model.language_model
        hidden = lm(inputs_embeds=lm.embed_tokens(ids)[None], position_ids=positions[:, None], use_cache=False)
        logits: Tensor = hf.lm_head(hidden.last_hidden_state)[0]
        return logits


def test_whole_prompt_logits_equal_transformers(models: tuple[Path, VLModel, Any]) -> None:
    _, ours, hf = models
    ids = prompt(41, seed=1)
    [logits] = HybridCache(ours.lm).step([("a", ids)])
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)
    # M-RoPE rows that differ (an image span): the partial interleaved rotary of the attention layers.
    positions = image_positions(41, start=6, h=3, w=4)
    [mm] = HybridCache(ours.lm).step([("a", ids)], positions={"a": positions})
    torch.testing.assert_close(mm, hf_logits(hf, ids, positions), atol=ATOL, rtol=0)
    assert not torch.allclose(mm[6:], logits[6:], atol=1e-2)  # the positions matter


def test_fused_gated_attention_equals_transformers(models: tuple[Path, VLModel, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The gated attention layers' CUDA path (fused: the q/k norms and the partial rotary in one function, the output
    gate in another; compiled there, run as written here in float32) gives transformers' logits, M-RoPE rows too."""
    from workers.engine.kernels import fused
    from workers.engine.models.qwen3_5 import lm as qwen3_5_lm

    _, ours, hf = models
    calls = {"qk": 0, "gate": 0}

    def counted(fn: Any, key: str) -> Any:
        def run(*args: Any) -> Any:
            calls[key] += 1
            return fn(*args)

        return run

    monkeypatch.setattr(fused, "worth_it", lambda x: True)
    monkeypatch.setattr(fused, "compiled", lambda fn: fn)
    monkeypatch.setattr(qwen3_5_lm, "qk_norm_partial_rope", counted(qwen3_5_lm.qk_norm_partial_rope, "qk"))
    monkeypatch.setattr(qwen3_5_lm, "gated_output", counted(qwen3_5_lm.gated_output, "gate"))
    layers = [m for m in ours.lm.modules() if isinstance(m, qwen3_5_lm.GatedAttention)]
    ids, positions = prompt(41, seed=1), image_positions(41, start=6, h=3, w=4)
    try:
        for layer in layers:
            layer.fused = True
        [logits] = HybridCache(ours.lm).step([("a", ids)], positions={"a": positions})
    finally:
        for layer in layers:
            layer.fused = False
    torch.testing.assert_close(logits, hf_logits(hf, ids, positions), atol=ATOL, rtol=0)
    assert layers and calls == {"qk": len(layers), "gate": len(layers)}


def test_the_fused_gated_attention_functions_trace_whole_at_the_warm_up_sizes() -> None:
    """fused.compiled traces with fullgraph=True, where a graph break is an error at start-up: both functions trace
    whole through AOT autograd (Inductor's codegen aside) at the warm-up's row counts (static, symbolic, one row)
    and give their eager results."""
    from workers.engine.models.qwen3_5.lm import gated_output, qk_norm_partial_rope

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d, r = 4, 2, 32, 8
    prep = torch.compile(qk_norm_partial_rope, fullgraph=True, dynamic=None, backend="aot_eager")
    gate = torch.compile(gated_output, fullgraph=True, dynamic=None, backend="aot_eager")
    for t in (2, 3, 1):
        q_gate = torch.randn(t, heads, 2 * d, generator=gen)
        k = torch.randn(t, kv_heads, d, generator=gen)
        weights = [torch.randn(d, generator=gen) for _ in range(2)]
        cos, sin = (torch.randn(t, 1, r, generator=gen) for _ in range(2))
        out = torch.randn(t, heads, d, generator=gen)
        args = (q_gate[..., :d], k, *weights, 1e-6, cos, sin, r)
        for got, want in zip(prep(*args), qk_norm_partial_rope(*args), strict=True):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(gate(out, q_gate[..., d:]), gated_output(out, q_gate[..., d:]))


def test_chunked_prefill_then_decode_equals_generate(models: tuple[Path, VLModel, Any]) -> None:
    """5 + 16 + the rest through the pools (has_initial on the later chunks), then decode steps."""
    _, ours, hf = models
    ids = prompt(37, seed=2)
    cache = HybridCache(ours.lm)
    chunked = [cache.step([("a", ids[a:b])])[0] for a, b in ((0, 5), (5, 21), (21, 37))]
    torch.testing.assert_close(torch.cat(chunked), hf_logits(hf, ids), atol=ATOL, rtol=0)
    expected = hf_greedy(hf, ids, NEW)
    assert len(expected) >= 4
    got = greedy(HybridCache(ours.lm), {"a": ids}, [{"a": 5}, {"a": 16}, {"a": 16}], NEW)
    assert got["a"][: len(expected)] == expected


def test_two_sequences_share_steps(models: tuple[Path, VLModel, Any]) -> None:
    """Different chunkings, one sequence decoding while the other still prefills, then batched decodes."""
    _, ours, hf = models
    prompts = {"a": prompt(37, seed=3), "b": prompt(19, seed=4)}
    plan = [{"a": 5, "b": 9}, {"b": 10, "a": 16}, {"a": 7}, {"a": 9}]
    got = greedy(HybridCache(ours.lm), prompts, plan, NEW)
    for name, ids in prompts.items():
        expected = hf_greedy(hf, ids, NEW)
        assert got[name][: len(expected)] == expected, name
    assert got["a"] != got["b"]


def test_snapshot_resumes_a_prefix(models: tuple[Path, VLModel, Any]) -> None:
    """Snapshots of "a" after 12 and 32 tokens (mid-chunk); "c" and "d" resume the same prompt from copies of them in
    fresh slots, on a's KV blocks, and answer as transformers does. Resumed from a zeroed slot instead, the answer
    changes: the restored state is what carries the prefix."""
    _, ours, hf = models
    ids = prompt(37, seed=5)
    cache = HybridCache(ours.lm)
    cache.step([("a", ids[:5])])
    cache.step([("a", ids[5:21])], snapshots=[("a", 7, 6)])  # after 12 tokens, into slot 6
    [last] = cache.step([("a", ids[21:])], snapshots=[("a", 11, 7)])  # after 32 tokens, into slot 7
    for snap in (6, 7):
        assert any(not torch.equal(p[snap], p[cache.slots["a"]]) for p in cache.pools)  # not the final state
    expected = hf_greedy(hf, ids, NEW)
    resumes = {"c": (12, 6, 4, [{"c": 9}, {"c": 16}]), "d": (32, 7, 5, [{"d": 5}])}
    for seq, (tokens, snap, fresh, plan) in resumes.items():
        cache.copy_slot(snap, fresh)
        cache.share_prefix(seq, "a", tokens, fresh)
        got = greedy(cache, {seq: ids}, plan, NEW)
        assert got[seq][: len(expected)] == expected, seq
    # The same resume from a zeroed slot: the first chunk's logits move far beyond rounding.
    cache.share_prefix("e", "a", 32, 3)
    for pool in cache.pools:
        pool[3] = 0
    [lost] = cache.step([("e", ids[32:])])
    assert (lost - last[-5:]).abs().max() > 0.5


def test_state_pools_are_allocated_and_bound(models: tuple[Path, VLModel, Any]) -> None:
    _, ours, _ = models
    lm: Qwen3_5LanguageModel = ours.lm
    spec = ours.spec
    assert spec.recurrent is not None
    pools = lm.allocate_state(3, torch.float32)
    layers = [layer.linear_attn for layer in lm.layers if isinstance(layer, LinearDecoderLayer)]
    assert len(layers) == spec.recurrent.num_layers == spec.num_layers - spec.kv_layers
    assert len(pools) == 2 * len(layers)
    conv, ssm = spec.recurrent.conv_shape(), spec.recurrent.ssm_shape()
    for i, mixer in enumerate(layers):
        assert pools[2 * i] is mixer.conv_state and pools[2 * i + 1] is mixer.ssm_state
        assert pools[2 * i].shape == (3, *conv) and pools[2 * i + 1].shape == (3, *ssm)
    assert all(p.dtype == torch.float32 and not p.any() for p in pools)
    assert sum(p[0].numel() * 4 for p in pools) == spec.recurrent.bytes_per_slot(torch.float32)
    meta = build_attention_metadata([1], [1], [[0]], 4)
    with pytest.raises(ValueError, match="one per full-attention layer"):  # every layer's cache, not the attention ones'
        lm(torch.zeros(1, spec.hidden_size), torch.zeros(3, 1, dtype=torch.long), [torch.zeros(1)] * spec.num_layers, meta)
