"""The flash-linear-attention path of Gated DeltaNet (workers/engine/kernels/gated_delta.py with gated_delta_fla.py):
on the CPU the wrapper's gathers, splits and scatters around fla's kernels (stand-ins with fla's signatures that run
transformers' torch functions) against the torch path; on CUDA the real fla kernels against the torch path, the kept
chunk states' probe, the decode step in a CUDA graph and the fused decode conv."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.workers.engine.kernels.gated_delta_harness import (
    K_HEADS,
    LOOSE,
    Inputs,
    close,
    make_meta,
    pools,
    run,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)
from workers.engine.kernels import gated_delta, gated_delta_fla


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


def gva(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """q and k with each key head repeated for the value heads that read it ([.., .., H, K], value head j reads key
    head j // (Hv / Hk)), as fla's kernels do inside: transformers' torch functions take GVA heads only in some
    versions (5.24 does, 5.17 does not)."""
    rep = v.shape[2] // q.shape[2]
    return (q, k) if rep == 1 else (q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2))


def fake_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, initial_state: Tensor,
               output_final_state: bool, use_qk_l2norm_in_kernel: bool, cu_seqlens: Tensor,
               cu_seqlens_cpu: Tensor, chunk_indices: Tensor) -> tuple[Tensor, Tensor]:
    """fla's varlen chunk rule as its signature says (q [1, T, H, K], initial_state [N, H, K, V], final float32),
    each sequence through transformers' torch function."""
    assert q.shape[0] == 1 and cu_seqlens.dtype == cu_seqlens_cpu.dtype == torch.int64
    assert cu_seqlens.tolist() == cu_seqlens_cpu.tolist() and initial_state.shape[0] == len(cu_seqlens) - 1
    assert output_final_state and chunk_indices.shape == (len(cu_seqlens) - 1, 2)  # stand-in: one row a sequence
    bounds = cu_seqlens_cpu.tolist()
    q, k = gva(q, k, v)
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
    q, k = gva(q, k, v)
    out, final = torch_recurrent_gated_delta_rule(
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
    q, k = gva(q, k, v)
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


@pytest.mark.parametrize("kept", [True, False])  # fla's kept-states pipeline passed its probe, or not (rounds)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lens", "has_initial", "snapshots"), FLA_CASES)
def test_the_fla_wrapper_gathers_splits_and_scatters_like_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, lens: list[int], has_initial: list[bool], snapshots: list[tuple[int, int, int]],
    pool_dtype: torch.dtype, kept: bool,
) -> None:
    """The fla path's own work (gathering states with garbage slots zeroed, one varlen call or rounds split at the
    snapshot points, the scatter back, snapshots) with fla's kernels stood in for by transformers' torch functions:
    it runs on the CPU whether fla is installed or not. The kernels themselves: the CUDA test below."""
    monkeypatch.setattr(gated_delta_fla, "_kernels", FAKE_KERNELS)
    monkeypatch.setattr(gated_delta_fla, "_tried", True)
    monkeypatch.setattr(gated_delta_fla, "_states", "fla internals" if kept else False)
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
    assert len(calls) == (1 if kept and inside and all(n % 64 == 0 for n in inside) else 0)  # the kept states or not


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
def test_the_kept_chunk_states_pass_their_probe_on_the_installed_fla(monkeypatch: pytest.MonkeyPatch) -> None:
    """The five internal calls agree with fla's public function on this device, on inputs shaped and typed like
    a serving call's: Qwen3.5-9B's layer in bf16 (else every step with a snapshot inside a sequence would fall back
    to rounds, silently slower). One dtype: each autotunes fla's pipeline afresh (~2 min of serial compiles)."""
    if not torch.cuda.is_available() or not gated_delta_fla.available():
        pytest.skip("needs CUDA and flash-linear-attention (fla-core)")
    monkeypatch.setattr(gated_delta_fla, "_states", None)
    (hk, hv, d), dtype = (16, 32, 128), torch.bfloat16
    like = tuple(torch.empty(*shape, device="cuda", dtype=t) for shape, t in (
        ((1, 9, hk, d), dtype), ((1, 9, hk, d), dtype), ((1, 9, hv, d), dtype), ((1, 9, hv), torch.float32),
        ((1, 9, hv), dtype), ((3, hv, d, d), dtype)))  # fmt: skip
    assert gated_delta_fla._load_states(like) is not None


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
