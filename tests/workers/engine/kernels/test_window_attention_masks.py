"""Sliding-window and in-image bidirectional attention (Gemma 4's sliding layers) on the SDPA backend, the CPU
reference path, against a dense softmax masked by transformers' own mask functions; and the helpers the CUDA
backends share (key ranges, span-row recomputation, windowed packed slots), which are plain torch."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.kernels.window_scenarios import Seq, make_step, reference, transformers_mask
from workers.engine.kernels.attention import gather_sequence_kv
from workers.engine.kernels.attention_masks import (
    attend_span_rows,
    gather_key_range,
    sequence_plan,
    sequence_spans,
    windowed_packed_kv_slots,
)
from workers.engine.kernels.kv_write_kernel import write_kv_cache
from workers.engine.kernels.torch_attention import SdpaBackend

D = 16
SCALE = D**-0.5 * 1.3  # not the default: it must be honoured

CASES = {
    # (sequences, window, bidirectional)
    "window_smaller_than_context": ([Seq(12, 6)], 5, False),
    "window_fresh_prompt": ([Seq(0, 11)], 4, False),
    "prefix_cached_plus_chunk": ([Seq(9, 7)], 0, False),
    "window_decodes": ([Seq(20, 1), Seq(2, 1), Seq(7, 1)], 4, False),
    "span_in_step": ([Seq(4, 12, ((6, 11),))], 0, True),
    "span_in_step_windowed": ([Seq(4, 12, ((6, 11),))], 3, True),
    # The span's first tokens are cached: its new rows see the cached span keys and each other both ways.
    "span_partly_cached": ([Seq(8, 8, ((5, 12),))], 0, True),
    "span_partly_cached_windowed": ([Seq(8, 8, ((5, 12),))], 4, True),
    "span_longer_than_window": ([Seq(2, 14, ((3, 14),))], 3, True),
    "two_sequences_two_images": ([Seq(5, 9, ((7, 12),)), Seq(0, 10, ((2, 5), (6, 9)))], 3, True),
    # A span ending before the step (all cached) and one beyond this sequence's interest: no change to its rows.
    "cached_span_and_decodes": ([Seq(10, 1, ((2, 6),)), Seq(9, 6, ((1, 4), (11, 15)))], 0, True),
}


@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (3, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_backend_matches_transformers_masks(case: str, heads: tuple[int, int]) -> None:
    seqs, window, bidirectional = CASES[case]
    step = make_step(seqs, hq=heads[0], hkv=heads[1], d=D, seed=len(case))
    out = SdpaBackend().forward(step.q, step.k, step.v, step.cache, step.meta, SCALE, window, bidirectional)
    torch.testing.assert_close(out, reference(step, SCALE, window, bidirectional), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", [c for c in CASES if "span" in c or "window" in c])
def test_the_cases_are_not_plain_causal(case: str) -> None:
    """Each case's window or spans change some row's mask, so a backend ignoring them fails the test above."""
    seqs, window, bidirectional = CASES[case]
    assert any(
        not torch.equal(transformers_mask(s, window, bidirectional), transformers_mask(s, 0, False)) for s in seqs
    )


def test_spans_count_only_on_bidirectional_layers() -> None:
    """A global layer (bidirectional False) and a step without spans (None) are causal, whatever else is set."""
    seqs = [Seq(4, 12, ((6, 11),)), Seq(3, 5, ((3, 7),))]
    step = make_step(seqs, seed=3)
    causal = reference(step, SCALE, 2, False)
    out = SdpaBackend().forward(step.q, step.k, step.v, step.cache, step.meta, SCALE, 2, False)
    torch.testing.assert_close(out, causal, atol=1e-5, rtol=1e-5)
    step.meta.bidir_spans = None
    step.meta.derived.clear()
    out = SdpaBackend().forward(step.q, None, None, step.cache, step.meta, SCALE, 2, True)
    torch.testing.assert_close(out, causal, atol=1e-5, rtol=1e-5)


def test_kv_none_attends_to_what_another_layer_wrote() -> None:
    """k = v = None (Gemma 4's KV-shared layers): the new tokens' K/V are already in the cache; nothing is
    written and the output is the one the writing call gives."""
    step = make_step([Seq(8, 8, ((5, 12),)), Seq(0, 6), Seq(13, 1)], seed=5)
    write_kv_cache(step.k, step.v, step.cache, step.meta.slot_mapping)
    before = step.cache.clone()
    out = SdpaBackend().forward(step.q, None, None, step.cache, step.meta, SCALE, 4, True)
    assert torch.equal(step.cache, before)
    torch.testing.assert_close(out, reference(step, SCALE, 4, True), atol=1e-5, rtol=1e-5)


def test_plans_keep_the_fast_paths() -> None:
    cpu = torch.device("cpu")
    fresh = sequence_plan(9, 9, 0, [], cpu)
    assert fresh.is_causal and fresh.mask is None and fresh.first_key == 0
    assert sequence_plan(9, 9, 9, [], cpu).is_causal  # a window as long as the sequence cuts nothing
    decode = sequence_plan(1, 30, 8, [], cpu)  # a decode row's window is its key range alone
    assert decode.mask is None and not decode.is_causal and decode.first_key == 22
    chunk = sequence_plan(4, 30, 8, [], cpu)  # rows 26..29 see from 19..22: a mask over keys 19..29
    assert chunk.first_key == 19 and chunk.mask is not None and chunk.mask.shape == (4, 11)
    assert chunk.mask.sum(1).tolist() == [8, 8, 8, 8]


def test_plans_are_built_once_per_layer_kind() -> None:
    step = make_step([Seq(4, 12, ((6, 11),))], seed=1)
    backend = SdpaBackend()
    backend.forward(step.q, step.k, step.v, step.cache, step.meta, SCALE, 3, True)
    plans = step.meta.derived["sdpa_plans:3:True"]
    backend.forward(step.q, None, None, step.cache, step.meta, SCALE, 3, True)
    backend.forward(step.q, None, None, step.cache, step.meta, SCALE, 0, False)
    assert step.meta.derived["sdpa_plans:3:True"] is plans and "sdpa_plans:0:False" in step.meta.derived


def test_key_range_reads_the_blocks_it_needs() -> None:
    step = make_step([Seq(17, 6)], block_size=4, seed=2)
    write_kv_cache(step.k, step.v, step.cache, step.meta.slot_mapping)
    k_all, v_all = gather_sequence_kv(step.cache, step.meta.block_tables[0], 23)
    for first, end in [(0, 23), (5, 23), (8, 12), (9, 10), (22, 23)]:
        k, v = gather_key_range(step.cache, step.meta.block_tables[0], first, end)
        assert torch.equal(k, k_all[first:end]) and torch.equal(v, v_all[first:end])


@pytest.mark.parametrize("window", [0, 3, 4, 50])
def test_span_rows_recomputed_over_a_causal_result_give_the_bidirectional_one(window: int) -> None:
    """What the CUDA backends do where their kernel has no mask for images: the causal (+ window) output, then the
    span rows recomputed, equals the bidirectional output."""
    seqs = [Seq(20, 1), Seq(5, 9, ((7, 12),)), Seq(0, 10, ((2, 5), (6, 9))), Seq(8, 8, ((5, 12),))]
    step = make_step(seqs, seed=window)
    backend = SdpaBackend()
    out = backend.forward(step.q, step.k, step.v, step.cache, step.meta, SCALE, window, False)
    fixed = attend_span_rows(out.clone(), step.q, step.cache, step.meta, SCALE, window, sequence_spans(step.meta, True))
    torch.testing.assert_close(fixed, reference(step, SCALE, window, True), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, fixed, atol=1e-3)


@pytest.mark.parametrize("window", [1, 3, 6, 100])
def test_windowed_packed_slots_hold_each_sequence_from_its_first_visible_key(window: int) -> None:
    seqs = [Seq(20, 1), Seq(5, 9), Seq(0, 10), Seq(13, 3)]
    step = make_step(seqs, block_size=4, seed=4)
    write_kv_cache(step.k, step.v, step.cache, step.meta.slot_mapping)
    slots, cu, longest = windowed_packed_kv_slots(step.meta, 4, window)
    firsts = [max(0, s.context - window + 1) for s in seqs]
    want_k = torch.cat([k[f:] for k, f in zip(step.full_k, firsts, strict=True)])
    assert torch.equal(step.cache.view(2, -1, 2, D)[0, slots], want_k)
    counts = [s.context + s.new - f for s, f in zip(seqs, firsts, strict=True)]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *torch.tensor(counts).cumsum(0).tolist()]
    assert longest == max(counts)
