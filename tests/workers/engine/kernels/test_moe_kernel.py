"""The Triton MoE decode kernels (routing, up + activation, down + combine; per token-expert pair up to
moe_kernel.PAIR_MAX_ROWS rows, per expert above: moe_batched.py) checked on the CPU through Triton's interpreter against
transformers' expert loops, for Qwen's SiLU experts and Gemma 4's tanh-GELU ones, and on CUDA in bf16."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.kernels.kernel_check import check_switch_turns_it_off, run_kernel_check

CHECK = """
import torch
from workers.engine.kernels import moe_kernel
from workers.engine.models.gemma4.moe import gelu_experts_loop
from workers.engine.models.qwen3_vl.moe import experts_loop

gen = torch.Generator().manual_seed(0)
# Sizes with partial blocks in every dimension (hidden 200 over blocks of 128 and 16, intermediate 40 over 16),
# expert counts that are and are not powers of two, top-1 and a top-k that is not one, one token and several.
for tokens, experts, top_k, hidden, inter in ((1, 8, 2, 200, 40), (5, 12, 3, 64, 48), (3, 16, 1, 128, 16)):
    x = torch.randn(tokens, hidden, generator=gen)
    logits = 3 * torch.randn(tokens, experts, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5

    # Routing: transformers' softmax in float32, top-k, renormalised; Gemma's per-expert scale on top.
    weights, ids = moe_kernel.route(logits, top_k)
    top, want_ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    assert torch.equal(ids, want_ids), (ids, want_ids)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    scale = torch.rand(experts, generator=gen) + 0.5
    scaled, scaled_ids = moe_kernel.route(logits, top_k, scale)
    assert torch.equal(scaled_ids, ids)
    torch.testing.assert_close(scaled, weights * scale[ids])

    # Float32: the kernels' math against the reference loops (SiLU for Qwen, tanh-GELU for Gemma 4).
    torch.testing.assert_close(moe_kernel.experts(x, weights, ids, gate_up, down),
                               experts_loop(x, weights, ids, gate_up, down), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(moe_kernel.experts(x, scaled, ids, gate_up, down, gelu=True),
                               gelu_experts_loop(x, scaled, ids, gate_up, down), rtol=1e-4, atol=1e-5)

    # bf16 as served: float32 accumulation, one rounding at the end.
    xb, gub, db = x.bfloat16(), gate_up.bfloat16(), down.bfloat16()
    got = moe_kernel.experts(xb, weights, ids, gub, db)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    want = moe_kernel.reference(xb.float(), weights, ids, gub.float(), db.float())
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2e-2)

    # FP8 stacks with per-row scales (fp8_layers.py's experts): the dequantized weights' product, and a scale read
    # from the wrong row would show (rows of different magnitudes).
    from workers.engine.kernels.fp8_quant import dequantize, quantize_rows
    rows_scale = torch.rand(experts, 2 * inter, 1, generator=gen) * 4 + 0.25
    q_gu, s_gu = quantize_rows(gate_up * rows_scale)
    q_d, s_d = quantize_rows(down * (torch.rand(experts, hidden, 1, generator=gen) * 4 + 0.25))
    got = moe_kernel.experts(x, weights, ids, q_gu, q_d, scales=(s_gu, s_d))
    want = moe_kernel.reference(x, weights, ids, dequantize(q_gu, s_gu), dequantize(q_d, s_d))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    wrong = moe_kernel.reference(x, weights, ids, dequantize(q_gu, s_gu.roll(1, 1)), dequantize(q_d, s_d))
    assert (wrong - want).abs().max() > 100 * (1e-5 + 1e-4 * want.abs().max())

# FP8 stacks with block scales (a block checkpoint's experts): 128 x 128 tiles where the gate rows are whole tiles,
# else per row and 128 columns; tiles of magnitudes 2^0 to 2^4 apart, so a scale read from another tile would show.
from workers.engine.kernels.fp8_quant import quantize_block


def ragged(*shape):
    w = torch.randn(*shape, generator=gen)
    tiles = torch.randint(0, 5, (shape[0], -(-shape[1] // 128), -(-shape[2] // 128)), generator=gen).float()
    return w * torch.exp2(tiles).repeat_interleave(128, 1).repeat_interleave(128, 2)[:, : shape[1], : shape[2]]


for tokens, experts, top_k, hidden, inter, tiled in ((1, 4, 2, 300, 128, True), (3, 5, 2, 136, 256, True),
                                                    (2, 4, 2, 300, 80, True), (2, 4, 2, 300, 40, False)):
    x = torch.randn(tokens, hidden, generator=gen) / 16
    weights, ids = moe_kernel.route(torch.randn(tokens, experts, generator=gen), top_k)
    gu = ragged(experts, 2 * inter, hidden) / hidden**0.5
    q_d, s_d = quantize_block(ragged(experts, hidden, inter) / inter**0.5)
    if tiled:
        q_gu, s_gu = quantize_block(gu)
    else:  # a scale per row and 128 columns, rows 2^0 to 2^3 apart
        gu = torch.nn.functional.pad(gu * torch.exp2(torch.randint(0, 4, (experts, 2 * inter, 1), generator=gen).float()), (0, -hidden % 128))
        q_gu, s_gu = quantize_rows(gu.reshape(experts, 2 * inter, -1, 128))
        q_gu, s_gu = q_gu.reshape(experts, 2 * inter, -1)[..., :hidden].contiguous(), s_gu.squeeze(-1)
    got = moe_kernel.experts(x, weights, ids, q_gu, q_d, scales=(s_gu, s_d))
    want = moe_kernel.reference(x, weights, ids, dequantize(q_gu, s_gu), dequantize(q_d, s_d))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    wrong = moe_kernel.reference(x, weights, ids, dequantize(q_gu, s_gu.roll(1, 2)), dequantize(q_d, s_d))
    assert (wrong - want).abs().max() > 100 * (1e-5 + 1e-4 * want.abs().max())
    # Gemma 4's experts: the same stacks behind a tanh-GELU gate
    torch.testing.assert_close(moe_kernel.experts(x, weights, ids, q_gu, q_d, gelu=True, scales=(s_gu, s_d)),
                               moe_kernel.reference(x, weights, ids, dequantize(q_gu, s_gu), dequantize(q_d, s_d), gelu=True),
                               rtol=1e-4, atol=1e-5)
# (inter 80: a tile spans the gate's last rows and the up's first.) 128 x 128 tiles over gate rows that are not whole
# blocks of the kernels' 16 rows: refused (fp8_layers.py keeps such scales per row)
q_gu, s_gu = quantize_block(torch.randn(2, 80, 128, generator=gen))
q_d, s_d = quantize_block(torch.randn(2, 128, 40, generator=gen))
try:
    moe_kernel.experts(torch.randn(1, 128), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), q_gu, q_d, scales=(s_gu, s_d))
except ValueError:
    pass
else:
    raise AssertionError("tiles over partial gate rows were accepted")

# FP8 stacks need their scales (and only they take them); the FP8 probe passes here too.
try:
    moe_kernel.experts(x, weights, ids, q_gu, q_d)
except ValueError:
    pass
else:
    raise AssertionError("FP8 stacks without scales were accepted")
assert moe_kernel.probe_fp8(torch.device("cpu"), torch.float32) and not moe_kernel.FP8_SWITCH.broken

# Decode batches past the per-pair kernels' rows: a program per expert finds its pairs by scanning the ids in blocks
# of moe_batched.BLOCK_P and serves them BLOCK_M at a time. Here more pairs than one scan block (70 x 3 = 210), experts
# with more pairs than one pass (~35 each), an expert no pair chose (its program reads nothing), partial blocks.
from workers.engine.kernels import moe_batched
for tokens, experts, top_k, hidden, inter, unused in ((70, 7, 3, 200, 40, 1), (12, 16, 1, 64, 80, 0),
                                                      (33, 12, 8, 136, 16, 2)):
    assert tokens > moe_kernel.PAIR_MAX_ROWS
    x = torch.randn(tokens, hidden, generator=gen)
    logits = 3 * torch.randn(tokens, experts, generator=gen)
    logits[:, experts - unused:] = -float("inf")
    weights, ids = moe_kernel.route(logits, top_k)
    assert int(ids.max()) < experts - unused
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    torch.testing.assert_close(moe_kernel.experts(x, weights, ids, gate_up, down),
                               experts_loop(x, weights, ids, gate_up, down), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(moe_kernel.experts(x, weights, ids, gate_up, down, gelu=True),
                               gelu_experts_loop(x, weights, ids, gate_up, down), rtol=1e-4, atol=1e-5)
    # Every pair's activations land in its own row, whatever its expert's rank order.
    h = moe_batched.up(x, ids, gate_up)
    for pair in range(tokens * top_k):
        g, u = (gate_up[ids.view(-1)[pair]] @ x[pair // top_k]).chunk(2)
        torch.testing.assert_close(h[pair], torch.nn.functional.silu(g) * u, rtol=1e-4, atol=1e-5)
assert moe_kernel.probe_batched(torch.device("cpu"), torch.float32) and not moe_batched.SWITCH.broken
# FP8 stacks in decode batches: each scale layout (per row, per row and 128 columns, 128 x 128 tiles over gate rows
# that are not whole tiles: a tile spans the gate's last rows and the up's first), tiles of magnitudes 2^0 to 2^4
# apart so a scale read from another tile would show; through ``experts`` as served, and each activation.
for inter, layout in ((40, "rows"), (80, "tiles"), (40, "row blocks")):
    tokens, experts, top_k, hidden = 19, 5, 2, 300
    x = torch.randn(tokens, hidden, generator=gen) / 16
    weights, ids = moe_kernel.route(torch.randn(tokens, experts, generator=gen), top_k)
    gu, dn = ragged(experts, 2 * inter, hidden) / hidden**0.5, ragged(experts, hidden, inter) / inter**0.5
    if layout == "rows":
        (q_gu, s_gu), (q_d, s_d) = quantize_rows(gu), quantize_rows(dn)
    elif layout == "tiles":
        (q_gu, s_gu), (q_d, s_d) = quantize_block(gu), quantize_block(dn)
    else:
        (q_gu, s_gu), (q_d, s_d) = quantize_block(gu), quantize_block(dn)
        s_gu, s_d = (t.repeat_interleave(128, dim=1)[:, : w.shape[1]] for t, w in ((s_gu, gu), (s_d, dn)))
    want = moe_kernel.reference(x, weights, ids, dequantize(q_gu, s_gu), dequantize(q_d, s_d))
    if layout != "tiles":  # (80 gate rows are not whole blocks of the per-pair kernels' 16: experts refuses them)
        torch.testing.assert_close(moe_kernel.experts(x, weights, ids, q_gu, q_d, scales=(s_gu, s_d)), want,
                                   rtol=1e-4, atol=1e-5)
    for gelu in (False, True):
        h = moe_batched.up(x, ids, q_gu, gelu, s_gu.float(), moe_kernel._scale_layout(q_gu, s_gu, 0))
        got = moe_batched.down(h, ids, weights, q_d, s_d.float(), moe_kernel._scale_layout(q_d, s_d, 0))
        got = got.view(tokens, top_k, hidden).sum(1)
        torch.testing.assert_close(got, moe_kernel.reference(x, weights, ids, dequantize(q_gu, s_gu),
                                                             dequantize(q_d, s_d), gelu=gelu), rtol=1e-4, atol=1e-5)
    shifted = s_gu.roll(1, 1 if layout == "rows" else 2)  # a neighbour row's scale, or the next 128 columns'
    wrong = moe_kernel.reference(x, weights, ids, dequantize(q_gu, shifted), dequantize(q_d, s_d))
    assert (wrong - want).abs().max() > 100 * (1e-5 + 1e-4 * want.abs().max())
assert moe_kernel.probe_batched_fp8(torch.device("cpu"), torch.float32) and not moe_batched.FP8_SWITCH.broken

# Two tokens routed to the same expert read its weights each; a stride-padded input takes a contiguous copy.
x = torch.randn(2, 4 * 64, generator=gen)[:, :64]
gate_up = torch.randn(4, 2 * 16, 64, generator=gen)
down = torch.randn(4, 64, 16, generator=gen)
ids = torch.tensor([[1, 3], [1, 0]])
w = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
torch.testing.assert_close(moe_kernel.experts(x, w, ids, gate_up, down), experts_loop(x, w, ids, gate_up, down),
                           rtol=1e-4, atol=1e-4)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the MoE tests run the kernels themselves")
def test_kernels_match_the_expert_loops_in_triton_interpreter() -> None:
    run_kernel_check(CHECK, "moe_kernel", "float32", timeout=300)


def test_only_a_few_cuda_rows_take_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine.kernels import moe_batched, moe_kernel

    gate_up = torch.zeros(4, 8, 16)
    # The CPU keeps transformers' loop (the exactness tests compare it), whatever the row count.
    assert not moe_kernel.wanted(torch.zeros(1, 16), gate_up)
    assert not moe_kernel.wanted(torch.zeros(0, 16), gate_up)
    assert not moe_kernel.wanted(torch.zeros(moe_kernel.MAX_ROWS + 1, 16), gate_up)
    check_switch_turns_it_off(monkeypatch, moe_batched, probe=moe_kernel.probe_batched)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_match_the_loop_in_bf16_and_replay_from_a_cuda_graph() -> None:
    from workers.engine.kernels import moe_kernel
    from workers.engine.models.qwen3_vl.moe import experts_loop

    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, top_k, hidden, inter = 128, 8, 2048, 768  # Qwen3-VL-30B-A3B's experts

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, device="cuda", generator=gen)).bfloat16()

    gate_up, down = draw(experts, 2 * inter, hidden, scale=hidden**-0.5), draw(experts, hidden, inter, scale=inter**-0.5)
    for rows in (1, 5, moe_kernel.PAIR_MAX_ROWS + 1, moe_kernel.MAX_ROWS + 1, 64, 128):  # per pair, then per expert
        # float32 logits: bf16 ones tie often among 128 experts, and either tied expert is a right top-k
        x, logits = draw(rows, hidden), torch.randn(rows, experts, device="cuda", generator=gen)
        weights, ids = moe_kernel.route(logits, top_k)
        top, want_ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
        assert torch.equal(ids, want_ids)
        want = experts_loop(x.float(), weights, ids, gate_up.float(), down.float())
        torch.testing.assert_close(moe_kernel.experts(x, weights, ids, gate_up, down).float(), want,
                                   rtol=2**-7, atol=2e-2)

    # Captured once, replayed on new inputs: the same answer as an eager call (the decode graphs' use), for the
    # per-pair kernels and the per-expert ones.
    for rows in (4, 48):
        assert moe_kernel.wanted(draw(rows, hidden), gate_up)
        x, logits = draw(rows, hidden), draw(rows, experts)
        eager = moe_kernel.experts(x, *moe_kernel.route(logits, top_k), gate_up, down)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = moe_kernel.experts(x, *moe_kernel.route(logits, top_k), gate_up, down)
        x.copy_(draw(rows, hidden))
        logits.copy_(draw(rows, experts))
        graph.replay()
        torch.testing.assert_close(replayed, moe_kernel.experts(x, *moe_kernel.route(logits, top_k), gate_up, down),
                                   rtol=0, atol=0)
        assert not torch.equal(replayed, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemma_grouped_experts_match_the_loop_past_the_kernels_rows() -> None:
    """Gemma 4's experts over more rows than the Triton kernels take: two grouped GEMMs with the tanh-GELU gate (no
    host sync, so a decode graph can hold them) give transformers' loop, float32 routing weights and all."""
    from workers.engine.kernels import moe_batched, moe_kernel
    from workers.engine.models.gemma4.moe import GemmaExperts, gelu_experts_loop

    gen = torch.Generator(device="cuda").manual_seed(1)
    experts, top_k, hidden, inter, rows = 128, 8, 2816, 704, moe_batched.MAX_ROWS + 3  # 26B-A4B's experts
    block = GemmaExperts(experts, hidden, inter).cuda().bfloat16()
    block.gate_up_proj.copy_(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden**-0.5)
    block.down_proj.copy_(torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter**-0.5)
    assert block.capturable()
    x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    weights, ids = moe_kernel.route(torch.randn(rows, experts, device="cuda", generator=gen), top_k)
    out = block(x, weights, ids)
    assert out.dtype == torch.bfloat16
    want = gelu_experts_loop(x.float(), weights, ids, block.gate_up_proj.float(), block.down_proj.float())
    torch.testing.assert_close(out.float(), want, rtol=2**-6, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs CUDA with FP8"
)
@pytest.mark.parametrize("layout", ["rows", "tiles"])
def test_fp8_stacks_match_the_dequantized_experts_in_bf16(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-VL-30B-A3B's experts at decode rows, FP8 with a scale per row (a channel checkpoint's) or per 128 x 128
    tile (a block checkpoint's): per pair, then per expert (moe_batched.py, opted in) past moe_kernel.MAX_ROWS rows."""
    from workers.engine.kernels import moe_batched, moe_kernel

    assert not moe_kernel.wanted(torch.zeros(moe_kernel.MAX_ROWS + 1, 8, dtype=torch.bfloat16, device="cuda"),
                                 torch.zeros(4, 16, 8, device="cuda").to(torch.float8_e4m3fn))  # opt-in
    monkeypatch.setenv(moe_batched.FP8_SWITCH.env, "1")
    from workers.engine.kernels.fp8_quant import dequantize, quantize_block, quantize_rows

    assert moe_kernel.probe_fp8(torch.device("cuda"), torch.bfloat16), moe_kernel.FP8_SWITCH.why_off()
    gen = torch.Generator(device="cuda").manual_seed(1)
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    quantize = quantize_rows if layout == "rows" else quantize_block
    q_gu, s_gu = quantize(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen))
    q_d, s_d = quantize(torch.randn(experts, hidden, inter, device="cuda", generator=gen))
    assert s_gu.shape == ((experts, 2 * inter, 1) if layout == "rows" else (experts, 12, 16))
    assert moe_kernel.probe_batched_fp8(torch.device("cuda"), torch.bfloat16), moe_batched.FP8_SWITCH.why_off()
    for rows in (1, moe_kernel.MAX_ROWS + 1, moe_batched.MAX_ROWS):
        assert moe_kernel.wanted(torch.zeros(rows, hidden, dtype=torch.bfloat16, device="cuda"), q_gu)
    for rows in (1, moe_kernel.MAX_ROWS, moe_kernel.MAX_ROWS + 1, 64):
        x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
        weights, ids = moe_kernel.route(torch.randn(rows, experts, device="cuda", generator=gen), top_k)
        got = moe_kernel.experts(x, weights, ids, q_gu, q_d, scales=(s_gu, s_d)).float()
        want = moe_kernel.reference(x.float(), weights, ids, dequantize(q_gu, s_gu), dequantize(q_d, s_d))
        # bf16 activations between the kernels (h) and out: relative RMS error within bf16 rounding's few ulps
        assert (got - want).pow(2).mean().sqrt() <= 0.01 * want.pow(2).mean().sqrt()
