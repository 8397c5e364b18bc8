"""Gated DeltaNet's kernels over a flattened batch with state pools (workers/engine/kernels/gated_delta.py) against
transformers' own Qwen3.5 functions: the conv (causal_conv1d_fn / causal_conv1d_update) and the gated delta rule
(torch_chunk_gated_delta_rule for prefill, torch_recurrent_gated_delta_rule for one-token decode), one sequence at a
time with its state passed by hand. CPU, float32 (plus bfloat16 pools), small heads; the CUDA test compares the
flash-linear-attention path with the torch path."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from workers.engine.kernels import gated_delta, gated_delta_fla
from workers.engine.kernels.attention import AttentionMetadata, StateMetadata

# transformers swaps in flash-linear-attention's or causal-conv1d's kernels where those packages import (CUDA only);
# the torch functions they wrap are the reference on every machine.
causal_conv1d_fn = inspect.unwrap(hf.causal_conv1d_fn)
causal_conv1d_update = inspect.unwrap(hf.causal_conv1d_update)
torch_chunk_gated_delta_rule = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
torch_recurrent_gated_delta_rule = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)

K_HEADS, K_DIM, V_DIM, KERNEL = 2, 32, 16, 4
SLOTS = 12
EXACT = 1e-5  # same chunking as the reference: rounding only
LOOSE = 1e-4  # another chunking (or a recurrent step for a chunk row): reassociated sums
BF16 = 2e-2


def make_meta(
    query_lens: list[int], slots: list[int], has_initial: list[bool],
    snapshots: list[tuple[int, int, int]] | None = None, device: str = "cpu",
) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(query_lens),
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        block_tables=torch.zeros(len(query_lens), 1, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(query_lens),
        state=StateMetadata(
            slots=torch.tensor(slots, dtype=torch.int64, device=device), slots_cpu=list(slots),
            has_initial=torch.tensor(has_initial, device=device), has_initial_cpu=list(has_initial),
            snapshots=list(snapshots or []),
        ),
    )


def close(got: Tensor, want: Tensor, tol: float) -> None:
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


class Inputs:
    """Random inputs shaped as Qwen3.5's GatedDeltaNet makes them: conv over q|k|v channels, g = -exp(A) *
    softplus(.) (negative), beta = sigmoid(.)."""

    def __init__(self, tokens: int, v_heads: int = K_HEADS, seed: int = 0, dtype: torch.dtype = torch.float32):
        gen = torch.Generator().manual_seed(seed)
        self.v_heads = v_heads
        self.channels = 2 * K_HEADS * K_DIM + v_heads * V_DIM
        self.x = torch.randn(tokens, self.channels, generator=gen).to(dtype)
        self.weight = (torch.randn(self.channels, KERNEL, generator=gen) * 0.5).to(dtype)
        self.bias = (torch.randn(self.channels, generator=gen) * 0.1).to(dtype)
        self.q = torch.randn(tokens, K_HEADS, K_DIM, generator=gen).to(dtype)
        self.k = torch.randn(tokens, K_HEADS, K_DIM, generator=gen).to(dtype)
        self.v = torch.randn(tokens, v_heads, V_DIM, generator=gen).to(dtype)
        a_log = torch.rand(v_heads, generator=gen).log()
        self.g = -a_log.exp() * F.softplus(torch.randn(tokens, v_heads, generator=gen) - 2)  # float32, as served
        self.beta = torch.randn(tokens, v_heads, generator=gen).sigmoid().to(dtype)

    def rows(self, s: int, e: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self.q[s:e], self.k[s:e], self.v[s:e], self.g[s:e], self.beta[s:e]


def pools(v_heads: int, channels: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> tuple[Tensor, Tensor]:
    """Pools full of random states (what other sequences left): a kernel must read only its own slots."""
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(SLOTS, channels, KERNEL - 1, generator=gen).to(dtype)
    ssm = (torch.randn(SLOTS, v_heads, K_DIM, V_DIM, generator=gen) * 0.3).to(dtype)
    return conv, ssm


def ref_conv(x: Tensor, weight: Tensor, bias: Tensor, window: Tensor | None) -> tuple[Tensor, Tensor]:
    """transformers' conv for one sequence's new rows x [n, C] after ``window`` [C, K-1] (None: no cache); returns
    the output [n, C] and the window after x."""
    n = x.shape[0]
    if window is not None and n == 1:  # cached decode
        state = window.clone().unsqueeze(0)
        out = causal_conv1d_update(x.t().unsqueeze(0), state, weight, bias, "silu")
        return out[0].t(), state[0]
    old = torch.zeros(x.shape[1], KERNEL - 1, dtype=x.dtype) if window is None else window
    full = torch.cat([old, x.t()], dim=1)
    if window is None:  # prefill without cache: the conv pads with zeros itself
        out = causal_conv1d_fn(x.t().unsqueeze(0), weight, bias, activation="silu")[0]
    else:  # prefill after a cached window (the Cache's update_conv_state): conv over [window; x], window rows dropped
        out = causal_conv1d_fn(full.unsqueeze(0), weight, bias, activation="silu")[0, :, -n:]
    return out.t(), full[:, -(KERNEL - 1):]


def ref_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
    """transformers' rule for one sequence, as Qwen3_5GatedDeltaNet calls it: recurrent for one cached token, else
    chunked. Returns output [n, Hv, Dv] and final state [Hv, Dk, Dv]."""
    rule = torch_recurrent_gated_delta_rule if state is not None and q.shape[0] == 1 else torch_chunk_gated_delta_rule
    out, final = rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        initial_state=None if state is None else state.unsqueeze(0), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert final is not None
    return out[0], final[0]


def run(inp: Inputs, meta: AttentionMetadata, conv: Tensor, ssm: Tensor, s: int = 0) -> tuple[Tensor, Tensor]:
    e = s + sum(meta.query_lens_cpu)
    conv_out = gated_delta.causal_conv1d(inp.x[s:e], inp.weight, inp.bias, conv, meta)
    rule_out = gated_delta.gated_delta_rule(*inp.rows(s, e), ssm, meta)
    return conv_out, rule_out


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


def test_the_fla_path_is_cuda_only_and_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not gated_delta.fla_path(torch.device("cpu"))
    monkeypatch.setenv("GLIMPSE_FLA", "0")
    assert not gated_delta.fla_path(torch.device("cuda", 0))


FLA_CASES = [
    ([1, 1, 1, 1], [True, False, True, True], [(2, 1, 7)]),  # all decode: the fused recurrent kernel
    ([1, 200, 1, 3, 130], [True, True, False, False, True], [(1, 200, 7), (0, 1, 8)]),  # one varlen call
    ([1, 150, 90], [True, True, False], [(1, 16, 7), (1, 100, 8), (1, 150, 9), (2, 64, 10), (0, 1, 11)]),  # rounds
    # every cut after whole 64-token chunks: one call, snapshots from the states fla keeps
    ([1, 200, 130, 64], [True, False, True, True],
     [(1, 64, 7), (1, 128, 8), (1, 200, 9), (2, 128, 10), (0, 1, 11), (3, 64, 6)]),
]


def fake_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, initial_state: Tensor,
               output_final_state: bool, use_qk_l2norm_in_kernel: bool, cu_seqlens: Tensor,
               cu_seqlens_cpu: Tensor, chunk_indices: Tensor) -> tuple[Tensor, Tensor]:
    """fla's varlen chunk rule as its signature says (q [1, T, H, K], initial_state [N, H, K, V], final float32),
    each sequence through transformers' torch function."""
    assert q.shape[0] == 1 and cu_seqlens.dtype == cu_seqlens_cpu.dtype == torch.int64
    assert cu_seqlens.tolist() == cu_seqlens_cpu.tolist() and initial_state.shape[0] == len(cu_seqlens) - 1
    assert output_final_state and chunk_indices.shape == (len(cu_seqlens) - 1, 2)  # stand-in: one row a sequence
    bounds = cu_seqlens_cpu.tolist()
    outs, finals = [], []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        out, final = torch_chunk_gated_delta_rule(
            *(t[:, s:e] for t in (q, k, v, g, beta)), initial_state=initial_state[i : i + 1].float(),
            output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        outs.append(out.to(v.dtype))
        finals.append(final)
    return torch.cat(outs, dim=1), torch.cat(finals)


def fake_indices(cu: Tensor, chunk: int, cu_seqlens_cpu: Tensor) -> Tensor:
    return torch.zeros(len(cu) - 1, 2, dtype=torch.int64)


def fake_recurrent(*, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, initial_state: Tensor,
                   output_final_state: bool, use_qk_l2norm_in_kernel: bool) -> tuple[Tensor, Tensor]:
    """fla's fused recurrent rule as its signature says (q [N, 1, H, K], initial_state [N, Hv, K, V], final float32),
    through transformers' torch function (which scales by 1/sqrt(K) itself)."""
    assert q.shape[1] == 1 and output_final_state and scale == q.shape[-1] ** -0.5
    out, final = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=initial_state.float(), output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return out.to(v.dtype), final


FAKE_KERNELS = (fake_chunk, fake_indices, fake_recurrent)


def fake_chunk_states(parts: object, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
                      use_qk_l2norm: bool, cu: Tensor, indices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fla's chunk pipeline with its kept states (gated_delta_fla._chunk_states: [1, T] inputs; the state before
    each 64-token chunk of each sequence, sequence after sequence, in k's dtype), through transformers' torch
    function a chunk at a time."""
    assert parts == "fla internals" and indices.shape == (len(cu) - 1, 2)
    bounds = cu.tolist()
    outs, kept, finals = [], [], []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = initial_state[i : i + 1].float()
        for c in range(s, e, gated_delta_fla.CHUNK):
            kept.append(state.to(k.dtype))
            rows = slice(c, min(c + gated_delta_fla.CHUNK, e))
            out, state = torch_chunk_gated_delta_rule(
                *(t[:, rows] for t in (q, k, v, g, beta)), initial_state=state, output_final_state=True,
                use_qk_l2norm_in_kernel=use_qk_l2norm,
            )
            outs.append(out.to(v.dtype))
        finals.append(state)
    return torch.cat(outs, dim=1), torch.cat(kept).unsqueeze(0), torch.cat(finals)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lens", "has_initial", "snapshots"), FLA_CASES)
def test_the_fla_wrapper_gathers_splits_and_scatters_like_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, lens: list[int], has_initial: list[bool], snapshots: list[tuple[int, int, int]],
    pool_dtype: torch.dtype,
) -> None:
    """The fla path's own work (gathering states with garbage slots zeroed, one varlen call or rounds split at the
    snapshot points, the scatter back, snapshots) with fla's kernels stood in for by transformers' torch functions:
    it runs on the CPU whether fla is installed or not. The kernels themselves: the CUDA test below."""
    monkeypatch.setattr(gated_delta_fla, "_kernels", FAKE_KERNELS)
    monkeypatch.setattr(gated_delta_fla, "_tried", True)
    monkeypatch.setattr(gated_delta_fla, "_states", "fla internals")
    calls: list[int] = []
    monkeypatch.setattr(gated_delta_fla, "_chunk_states", lambda *a: calls.append(1) or fake_chunk_states(*a))
    inp = Inputs(sum(lens), v_heads=2 * K_HEADS, seed=8)
    _, ssm = pools(inp.v_heads, inp.channels, dtype=pool_dtype)
    slots = [3, 0, 5, 1, 9][: len(lens)]
    for slot, initial in zip(slots, has_initial):
        if not initial:
            ssm[slot] = float("nan")
    ssm_t = ssm.clone()
    meta = make_meta(lens, slots, has_initial, snapshots)
    got = gated_delta_fla.gated_delta_rule(*inp.rows(0, sum(lens)), ssm, meta, True)
    want = gated_delta._torch_gated_delta(*inp.rows(0, sum(lens)), ssm_t, meta, True)
    close(got, want, LOOSE)
    # Every slot (the untouched ones equal); in bfloat16 one rounding apart at most.
    close(ssm.float(), ssm_t.float(), LOOSE if pool_dtype == torch.float32 else 1e-2)
    inside = [n for b, n, _ in snapshots if n < lens[b]]
    assert len(calls) == (1 if inside and all(n % 64 == 0 for n in inside) else 0)  # the kept states or not


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_the_fla_decode_step_gathers_and_scatters_like_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, pool_dtype: torch.dtype
) -> None:
    """An all-decode step on the fused recurrent kernel (stood in for by transformers' torch function, keywords only
    as fla's signature needs): garbage in the slots of sequences without state is ignored, every slot and the
    snapshot are written as the torch path writes them."""
    monkeypatch.setattr(gated_delta_fla, "_kernels", FAKE_KERNELS)
    monkeypatch.setattr(gated_delta_fla, "_tried", True)
    lens, slots, has_initial = [1, 1, 1, 1], [3, 0, 5, 1], [True, False, True, True]
    inp = Inputs(4, v_heads=2 * K_HEADS, seed=9)
    _, ssm = pools(inp.v_heads, inp.channels, dtype=pool_dtype)
    ssm[0] = float("nan")
    ssm_t = ssm.clone()
    meta = make_meta(lens, slots, has_initial, [(2, 1, 7)])
    got = gated_delta_fla.decode_step(*inp.rows(0, 4), ssm, meta, True)
    want = gated_delta._torch_gated_delta(*inp.rows(0, 4), ssm_t, meta, True)
    close(got, want, LOOSE)
    close(ssm.float(), ssm_t.float(), LOOSE if pool_dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fla_path_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.delenv("GLIMPSE_FLA", raising=False)
    if not gated_delta.fla_path(torch.device("cuda")):
        pytest.skip("flash-linear-attention (fla-core) does not import")
    for lens, has_initial, snapshots in FLA_CASES:
        inp = Inputs(sum(lens), v_heads=2 * K_HEADS, seed=8, dtype=dtype)
        for name in ("x", "weight", "bias", "q", "k", "v", "g", "beta"):
            setattr(inp, name, getattr(inp, name).cuda())
        conv, ssm = (p.to(dtype).cuda() for p in pools(inp.v_heads, inp.channels))
        slots = list(range(len(lens)))
        for b, initial in enumerate(has_initial):
            if not initial:
                conv[b], ssm[b] = float("nan"), float("nan")
        conv_t, ssm_t = conv.clone(), ssm.clone()
        meta = make_meta(lens, slots, has_initial, snapshots, device="cuda")
        _, got = run(inp, meta, conv, ssm)
        monkeypatch.setenv("GLIMPSE_FLA", "0")
        _, want = run(inp, meta, conv_t, ssm_t)
        monkeypatch.delenv("GLIMPSE_FLA")
        # fla's float32 dots may run in TF32, and in bfloat16 it keeps the chunk states in bfloat16: relative
        # error over the whole tensor rather than per element.
        tol = 5e-3 if dtype == torch.float32 else 2e-2
        written = slots + [slot for _, _, slot in snapshots]
        assert rel_err(got, want) < tol and rel_err(ssm[written], ssm_t[written]) < tol, (lens, dtype)
        assert torch.equal(conv, conv_t)


@pytest.mark.gpu
def test_the_kept_chunk_states_pass_their_probe_on_the_installed_fla() -> None:
    """The five internal calls agree with fla's public function on this device (else every step with a snapshot
    inside a sequence would fall back to rounds, silently slower)."""
    if not torch.cuda.is_available() or not gated_delta_fla.available():
        pytest.skip("needs CUDA and flash-linear-attention (fla-core)")
    assert gated_delta_fla._load_states() is not None


def rel_err(got: Tensor, want: Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
def test_an_all_decode_step_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed on new inputs: the same results as an eager step (no host sync broke the capture,
    nothing data-dependent was frozen in). Two padding rows share a scratch slot (11), as the runner pads. (The
    path in use: fla's fused recurrent kernel where it imports, else the torch step.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    slots, has_initial = [2, 5, 7, 11, 11], [True, False, True, True, True]
    meta = make_meta([1] * 5, slots, has_initial, snapshots=[(2, 1, 9)], device="cuda")
    inp = Inputs(5, v_heads=2 * K_HEADS, seed=9, dtype=torch.bfloat16)
    names = ("x", "weight", "bias", "q", "k", "v", "g", "beta")
    for name in names:
        setattr(inp, name, getattr(inp, name).cuda())
    conv, ssm = (p.to(torch.bfloat16).cuda() for p in pools(inp.v_heads, inp.channels))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first use (allocations, lazy init) outside the capture
        run(inp, meta, conv.clone(), ssm.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        conv_out, out = run(inp, meta, conv, ssm)
    fresh = Inputs(5, v_heads=2 * K_HEADS, seed=10, dtype=torch.bfloat16)
    for name in names:
        getattr(inp, name).copy_(getattr(fresh, name))
    start_conv, start_ssm = conv.clone(), ssm.clone()
    graph.replay()
    want_conv, want = run(inp, meta, start_conv, start_ssm)
    real = [2, 5, 7, 9]
    assert torch.equal(conv_out[:3], want_conv[:3]) and torch.equal(out[:3], want[:3])
    assert torch.equal(conv[real], start_conv[real]) and torch.equal(ssm[real], start_ssm[real])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_decode_conv_matches_the_eager_one(dtype: torch.dtype) -> None:
    """An all-decode step's conv as one compiled kernel (``fuse``): the same outputs, windows and snapshot as the
    eager branch, garbage in a slot without initial state ignored."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(3)
    channels, kernel = 96, 4
    x = torch.randn(4, channels, device="cuda", dtype=dtype)
    weight = torch.randn(channels, kernel, device="cuda", dtype=dtype)
    conv = torch.randn(12, channels, kernel - 1, device="cuda", dtype=dtype)
    conv[0] = float("nan")
    meta = make_meta([1, 1, 1, 1], [3, 0, 5, 1], [True, False, True, True], [(2, 1, 7)], device="cuda")
    eager_pool = conv.clone()
    want = gated_delta.causal_conv1d(x, weight, None, eager_pool, meta)
    got = gated_delta.causal_conv1d(x, weight, None, conv, meta, fuse=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    close(got.float(), want.float(), tol)
    close(conv.float(), eager_pool.float(), tol)
