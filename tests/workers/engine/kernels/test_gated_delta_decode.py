"""The in-place gated delta decode kernel (gated_delta_decode.py) against the torch step that the exactness tests tie
to transformers: on the CPU through Triton's interpreter (the kernel's own code, float32), on CUDA compiled, in both
pool dtypes, through the decode dispatch and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.workers.engine.kernels.gated_delta_harness import make_meta
from tests.workers.engine.kernels.kernel_check import check_switch_turns_it_off, run_kernel_check
from workers.engine.kernels import gated_delta, gated_delta_decode

SLOTS, HAS_INITIAL = [3, 1, 0, 5], [True, False, True, True]


def inputs(hk: int, hv: int, kd: int, vd: int) -> tuple[Tensor, ...]:
    """q, k (strided views, as a projection's split gives them), v, g, beta and a pool whose slot 1 holds NaN (the
    fresh sequence's slot: an earlier owner's garbage must not be read)."""
    gen = torch.Generator().manual_seed(hk * 100 + hv * 10 + kd)
    n = len(SLOTS)
    wide = torch.randn(n, 3 * hk, kd, generator=gen)
    v = torch.randn(n, hv, vd, generator=gen)
    g, beta = -torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    pool = torch.randn(8, hv, kd, vd, generator=gen) * 0.1
    pool[1] = float("nan")
    return wide[:, :hk], wide[:, hk : 2 * hk], v, g, beta, pool


CHECK = """
import pytest
import torch
from tests.workers.engine.kernels.gated_delta_harness import make_meta
from tests.workers.engine.kernels.test_gated_delta_decode import HAS_INITIAL, SLOTS, inputs
from workers.engine.kernels import gated_delta, gated_delta_decode

snapshots = [(0, 1, 6), (2, 1, 2)]
touched = SLOTS + [s for _, _, s in snapshots]
# (key heads, value heads, key dim, value dim, block_v): GVA 1:2 and 1:3, dims that are not powers of two and value
# dims that BV does not divide (masked lanes on both axes); with and without the l2 norms.
for hk, hv, kd, vd, block_v, l2 in ((2, 4, 32, 32, 16, True), (1, 3, 24, 40, 16, True), (2, 2, 16, 48, 32, False)):
    q, k, v, g, beta, pool = inputs(hk, hv, kd, vd)
    fresh = pool.clone()
    want_pool = pool.clone()
    want = gated_delta._torch_gated_delta(q, k, v, g, beta, want_pool, make_meta([1] * 4, SLOTS, HAS_INITIAL,
                                                                                 snapshots), l2)
    got = gated_delta_decode.decode_step(q, k, v, g, beta, pool,
                                         make_meta([1] * 4, SLOTS, HAS_INITIAL, snapshots).state, l2, block_v=block_v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[touched], want_pool[touched], rtol=1e-5, atol=1e-5)
    others = [s for s in range(pool.shape[0]) if s not in touched]
    assert torch.equal(pool[others], fresh[others])  # no other slot written
with pytest.raises(ValueError, match="row-major"):
    gated_delta_decode.decode_step(q, k, v, g, beta, pool.transpose(-1, -2),
                                   make_meta([1] * 4, SLOTS, HAS_INITIAL).state, True)
"""


def test_the_kernel_updates_the_pool_in_place_as_the_torch_step_in_triton_interpreter() -> None:
    run_kernel_check(CHECK, "gated_delta_decode", "float32", timeout=300)


MIXED = """
import torch
from tests.workers.engine.kernels.gated_delta_harness import K_HEADS, LOOSE, Inputs, close, make_meta, pools
from tests.workers.engine.kernels.test_gated_delta_fla import FAKE_KERNELS, FLA_CASES
from workers.engine.kernels import gated_delta, gated_delta_fla

# fla's kernels stood in for by transformers' torch functions (as test_gated_delta_fla does), its kept-states path off
gated_delta_fla._kernels, gated_delta_fla._tried, gated_delta_fla._states = FAKE_KERNELS, True, False
cases = [c for c in FLA_CASES if c[0][0] == 1 and any(n > 1 for n in c[0])]
cases.append(([1, 1, 1, 37, 1, 90], [True, True, False, True, True, False], [(1, 1, 9), (3, 16, 10), (5, 90, 11)]))
for lens, has_initial, snapshots in cases:
    slots = [3, 0, 5, 2, 4, 1][: len(lens)]
    meta = make_meta(lens, slots, has_initial, snapshots)
    split = gated_delta.decode_split(meta)
    leading = next(i for i, n in enumerate(lens) if n != 1)
    assert split is not None and split[0] == leading and gated_delta.decode_split(meta) is split
    inp = Inputs(sum(lens), v_heads=2 * K_HEADS, seed=5)
    _, ssm = pools(inp.v_heads, inp.channels)
    for b, fresh in enumerate(has_initial):
        if not fresh:
            ssm[slots[b]] = float("nan")
    start, want_ssm = ssm.clone(), ssm.clone()
    want = gated_delta._torch_gated_delta(*inp.rows(0, sum(lens)), want_ssm, meta, True)
    got = gated_delta.mixed_step(*inp.rows(0, sum(lens)), ssm, split, True)
    close(got, want, LOOSE)
    touched = slots + [slot for _, _, slot in snapshots]
    close(ssm[touched], want_ssm[touched], LOOSE)
    others = [s for s in range(ssm.shape[0]) if s not in touched]
    assert torch.equal(ssm[others], start[others])
    # into a static buffer's leading rows (piecewise graphs): the decode rows from the kernel, the rest copied
    t = sum(lens)
    buf = torch.full((t + 2, *want.shape[1:]), float("nan"), dtype=want.dtype)
    assert gated_delta.mixed_step(*inp.rows(0, t), start.clone(), split, True, buf[:t]).data_ptr() == buf.data_ptr()
    close(buf[:t], want, LOOSE)
    assert buf[t:].isnan().all()
assert gated_delta.decode_split(make_meta([1, 1], [0, 1], [True, True])) is None  # nothing but decodes
assert gated_delta.decode_split(make_meta([5, 1], [0, 1], [True, True])) is None  # no leading decode
"""


def test_a_mixed_steps_decodes_take_the_kernel_and_its_chunks_fla_in_triton_interpreter() -> None:
    """A step of leading decodes and prefill chunks split in two (the decodes on the in-place kernel, the chunks on
    the fla wrapper, here with transformers' functions standing in for fla's kernels) equals the torch path over the
    whole step: outputs, every slot and snapshot, no other slot written."""
    run_kernel_check(MIXED, "gated_delta_decode", "float32", timeout=300)


@pytest.mark.parametrize("l2", [True, False])
def test_the_probes_reference_is_the_torch_step(l2: bool) -> None:
    q, k, v, g, beta, pool = inputs(1, 3, 24, 40)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = gated_delta._torch_gated_delta(q, k, v, g, beta, want_pool, make_meta([1] * 4, SLOTS, HAS_INITIAL), l2)
    got = gated_delta_decode.reference_step(q, k, v, g, beta, got_pool, SLOTS, HAS_INITIAL, l2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_pool[SLOTS], want_pool[SLOTS], rtol=1e-5, atol=1e-5)


def test_the_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    check_switch_turns_it_off(monkeypatch, gated_delta_decode)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_decode_dispatch_takes_it_and_it_replays_in_a_graph(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gated_delta_decode.SWITCH.reset()
    assert gated_delta_decode.probe(torch.device("cuda"), dtype), gated_delta_decode.SWITCH.why_off()
    q, k, v, g, beta, pool = inputs(16, 48, 128, 128)
    want_pool = pool.clone()
    want = gated_delta._torch_gated_delta(q, k, v, g, beta, want_pool, make_meta([1] * 4, SLOTS, HAS_INITIAL), True)
    dq, dk, dv, dg, db = (x.cuda().to(dtype) for x in (q, k, v, g, beta))
    dev_pool = pool.cuda().to(dtype)
    meta = make_meta([1] * 4, SLOTS, HAS_INITIAL, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first use (compile, allocations) outside the capture
        gated_delta.gated_delta_rule(dq, dk, dv, dg, db, dev_pool.clone(), meta)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_delta.gated_delta_rule(dq, dk, dv, dg, db, dev_pool, meta)
    graph.replay()
    tol = 2e-4 if dtype == torch.float32 else 6e-2  # bf16 inputs and pool against a float32 reference
    torch.testing.assert_close(out.float().cpu(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(dev_pool.float().cpu()[SLOTS], want_pool[SLOTS], rtol=tol, atol=tol)
