"""Gated DeltaNet's kernels over a flattened batch with state pools (workers/engine/kernels/gated_delta.py) against
transformers' own Qwen3.5 functions: the conv (causal_conv1d_fn / causal_conv1d_update) and the gated delta rule
(torch_chunk_gated_delta_rule for prefill, torch_recurrent_gated_delta_rule for one-token decode), one sequence at a
time with its state passed by hand. CPU, float32 (plus bfloat16 pools), small heads."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.kernels.gated_delta_harness import (
    BF16,
    EXACT,
    K_HEADS,
    LOOSE,
    SLOTS,
    Inputs,
    causal_conv1d_fn,
    close,
    make_meta,
    pools,
    ref_conv,
    ref_rule,
    run,
)
from workers.engine.kernels import gated_delta


def test_one_long_sequence_without_initial_state_ignores_a_garbage_slot() -> None:
    inp = Inputs(200)  # three whole chunks and a partial one
    conv, ssm = pools(inp.v_heads, inp.channels)
    conv[5], ssm[5] = float("nan"), float("inf")
    before_conv, before_ssm = conv.clone(), ssm.clone()
    conv_out, out = run(inp, make_meta([200], [5], [False]), conv, ssm)
    want_conv, want_window = ref_conv(inp.x, inp.weight, inp.bias, None)
    want, want_state = ref_rule(*inp.rows(0, 200), None)
    close(conv_out, want_conv, EXACT)
    close(conv[5], want_window, 0)  # the last K-1 inputs themselves
    close(out, want, EXACT)
    close(ssm[5], want_state, EXACT)
    others = [s for s in range(SLOTS) if s != 5]
    assert torch.equal(conv[others], before_conv[others]) and torch.equal(ssm[others], before_ssm[others])


@pytest.mark.parametrize("pieces", [[16] * 10, [64, 64, 32], [7, 1, 1, 33, 64, 2, 1, 51], [1, 1, 2, 156]])
def test_a_sequence_cut_across_calls_equals_one_reference_call(pieces: list[int]) -> None:
    total = sum(pieces)
    inp = Inputs(total, seed=2)
    conv, ssm = pools(inp.v_heads, inp.channels)
    conv_outs, outs, s = [], [], 0
    for i, n in enumerate(pieces):
        conv_out, out = run(inp, make_meta([n], [3], [i > 0]), conv, ssm, s)
        conv_outs.append(conv_out)
        outs.append(out)
        s += n
    want_conv, want_window = ref_conv(inp.x, inp.weight, inp.bias, None)
    want, want_state = ref_rule(*inp.rows(0, total), None)
    close(torch.cat(conv_outs), want_conv, EXACT)
    close(conv[3], want_window, 0)
    close(torch.cat(outs), want, LOOSE)
    close(ssm[3], want_state, LOOSE)


@pytest.mark.parametrize("v_heads", [K_HEADS, 2 * K_HEADS])
def test_a_mixed_batch_matches_each_sequence_alone(v_heads: int) -> None:
    """Decodes and prefills in one step, on scattered slots; a prefill and a one-token prompt without initial state
    on slots holding garbage. GQA where v_heads = 2 * k_heads."""
    lens = [1, 70, 1, 3, 130, 1]
    slots = [9, 2, 0, 7, 4, 11]
    has_initial = [True, True, True, False, False, False]
    inp = Inputs(sum(lens), v_heads=v_heads, seed=3)
    conv, ssm = pools(v_heads, inp.channels)
    for slot, initial in zip(slots, has_initial):
        if not initial:
            conv[slot], ssm[slot] = float("nan"), float("nan")
    start_conv, start_ssm = conv.clone(), ssm.clone()
    conv_out, out = run(inp, make_meta(lens, slots, has_initial), conv, ssm)
    s = 0
    for n, slot, initial in zip(lens, slots, has_initial):
        e = s + n
        want_conv, want_window = ref_conv(inp.x[s:e], inp.weight, inp.bias, start_conv[slot] if initial else None)
        want, want_state = ref_rule(*inp.rows(s, e), start_ssm[slot] if initial else None)
        tol = EXACT if initial or n > 1 else LOOSE  # a fresh one-token prompt: the reference runs it chunked
        close(conv_out[s:e], want_conv, EXACT)
        close(conv[slot], want_window, 0)
        close(out[s:e], want, tol)
        close(ssm[slot], want_state, tol)
        s = e
    untouched = [s for s in range(SLOTS) if s not in slots]
    assert torch.equal(conv[untouched], start_conv[untouched]) and torch.equal(ssm[untouched], start_ssm[untouched])


def test_an_all_decode_step_matches_the_recurrent_reference() -> None:
    slots, has_initial = [6, 1, 10, 3], [True, False, True, True]
    inp = Inputs(4, v_heads=2 * K_HEADS, seed=4)
    conv, ssm = pools(inp.v_heads, inp.channels)
    conv[1], ssm[1] = float("nan"), float("nan")
    start_conv, start_ssm = conv.clone(), ssm.clone()
    conv_out, out = run(inp, make_meta([1] * 4, slots, has_initial, snapshots=[(2, 1, 8)]), conv, ssm)
    for b, (slot, initial) in enumerate(zip(slots, has_initial)):
        window = start_conv[slot] if initial else torch.zeros_like(start_conv[slot])
        state = start_ssm[slot] if initial else torch.zeros_like(start_ssm[slot])
        want_conv, want_window = ref_conv(inp.x[b : b + 1], inp.weight, inp.bias, window)
        want, want_state = ref_rule(*inp.rows(b, b + 1), state)
        close(conv_out[b : b + 1], want_conv, EXACT)
        close(conv[slot], want_window, 0)
        close(out[b : b + 1], want, EXACT)
        close(ssm[slot], want_state, EXACT)
    assert torch.equal(conv[8], conv[10]) and torch.equal(ssm[8], ssm[10])  # the snapshot of sequence 2


def test_snapshots_hold_the_state_of_a_run_truncated_there() -> None:
    lens, slots = [1, 150, 90], [0, 1, 2]
    points = [(1, 1, 3), (1, 2, 4), (1, 16, 5), (1, 64, 6), (1, 100, 7), (1, 150, 8), (2, 64, 9), (0, 1, 10)]
    inp = Inputs(sum(lens), seed=5)
    conv, ssm = pools(inp.v_heads, inp.channels)
    start_conv, start_ssm = conv.clone(), ssm.clone()
    conv_out, out = run(inp, make_meta(lens, slots, [True, True, False], points), conv, ssm)
    starts = [0, 1, 151]
    for b, n, slot in points:
        s = starts[b]
        initial = b != 2
        _, want_window = ref_conv(inp.x[s : s + n], inp.weight, inp.bias, start_conv[slots[b]] if initial else None)
        _, want_state = ref_rule(*inp.rows(s, s + n), start_ssm[slots[b]] if initial else None)
        close(conv[slot], want_window, 0)
        close(ssm[slot], want_state, EXACT if n in (1, 150, 64) else LOOSE)
    # The split at the snapshot points leaves the outputs and final states as one run gives them.
    conv2, ssm2 = start_conv.clone(), start_ssm.clone()
    conv_plain, plain = run(inp, make_meta(lens, slots, [True, True, False]), conv2, ssm2)
    assert torch.equal(conv_out, conv_plain) and torch.equal(conv[slots], conv2[slots])
    close(out, plain, LOOSE)
    close(ssm[slots], ssm2[slots], LOOSE)
    assert not torch.allclose(ssm[5], ssm[6], atol=1e-3)  # the snapshots differ from one another


def test_bfloat16_pools_and_inputs_stay_close_to_the_float32_reference() -> None:
    lens, slots, has_initial = [1, 80, 1], [4, 5, 6], [True, False, True]
    inp32 = Inputs(sum(lens), v_heads=2 * K_HEADS, seed=6)
    inp = Inputs(sum(lens), v_heads=2 * K_HEADS, seed=6, dtype=torch.bfloat16)
    conv32, ssm32 = pools(inp.v_heads, inp.channels)
    conv, ssm = conv32.to(torch.bfloat16), ssm32.to(torch.bfloat16)
    conv32, ssm32 = conv.float(), ssm.float()  # the same starting states, rounded once
    conv_out, out = run(inp, make_meta(lens, slots, has_initial), conv, ssm)
    assert conv.dtype == ssm.dtype == conv_out.dtype == out.dtype == torch.bfloat16
    inp32.x, inp32.weight, inp32.bias = inp.x.float(), inp.weight.float(), inp.bias.float()
    inp32.q, inp32.k, inp32.v, inp32.beta = inp.q.float(), inp.k.float(), inp.v.float(), inp.beta.float()
    want_conv, want = run(inp32, make_meta(lens, slots, has_initial), conv32, ssm32)
    close(conv_out.float(), want_conv, BF16)
    close(out.float(), want, BF16)
    close(ssm[slots].float(), ssm32[slots], BF16)
    close(conv[slots].float(), conv32[slots], 0)  # inputs kept exactly


def test_the_conv_without_activation_and_an_unknown_one() -> None:
    inp = Inputs(5, seed=7)
    conv, _ = pools(inp.v_heads, inp.channels)
    meta = make_meta([5], [0], [False])
    plain = gated_delta.causal_conv1d(inp.x, inp.weight, inp.bias, conv.clone(), meta, activation=None)
    want = causal_conv1d_fn(inp.x.t().unsqueeze(0), inp.weight, inp.bias, activation=None)[0].t()
    close(plain, want, EXACT)
    with pytest.raises(ValueError, match="gelu"):
        gated_delta.causal_conv1d(inp.x, inp.weight, inp.bias, conv, meta, activation="gelu")
