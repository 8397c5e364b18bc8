"""The jitted kernels of moe_batched.py (imported on first use, so that importing the engine needs no Triton)."""

import triton
import triton.language as tl


@triton.jit
def pair_count(ids_ptr, P, expert, BLOCK_P: tl.constexpr):
    """How many of the P token-expert pairs chose ``expert``."""
    count = tl.full([], 0, tl.int32)
    for p0 in tl.range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        hit = tl.load(ids_ptr + p, mask=p < P, other=-1) == expert
        count += tl.sum(hit.to(tl.int32), 0)
    return count


@triton.jit
def pair_rows(ids_ptr, P, expert, first, count, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """The indices of ``expert``'s pairs of rank first .. first + BLOCK_M - 1 (ranks in pair order), and which
    of the BLOCK_M slots hold one."""
    slot = first + tl.arange(0, BLOCK_M)
    pairs = tl.zeros([BLOCK_M], tl.int32)
    seen = tl.full([], 0, tl.int32)
    for p0 in tl.range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        hit = (tl.load(ids_ptr + p, mask=p < P, other=-1) == expert).to(tl.int32)
        rank = seen + tl.cumsum(hit, 0) - 1
        match = (hit[None, :] > 0) & (rank[None, :] == slot[:, None])
        pairs += tl.sum(tl.where(match, p[None, :], 0), 1)
        seen += tl.sum(hit, 0)
    return pairs.to(tl.int64), slot < count


@triton.jit
def product(acc, a, w, scales, k0, IEEE: tl.constexpr, FP8: tl.constexpr, BLOCKS: tl.constexpr):
    """acc + a @ w for one block of the reduction. FP8 weights are widened to a's dtype in registers; with block
    scales (``scales``: [BLOCK_N] pointers to each weight row's first 128-column scale) this block's product is
    scaled before it is added (BLOCK_K divides 128, so the block has one scale a row)."""
    if FP8:
        w = w.to(a.dtype)
    if FP8 and BLOCKS:
        if IEEE:
            part = tl.dot(a, w, input_precision="ieee")
        else:
            part = tl.dot(a, w)
        return acc + part * tl.load(scales + k0 // 128)[None, :]
    if IEEE:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def row_scales(s_ptr, expert, rows, SCALE_ROWS: tl.constexpr, ROWS_PER_SCALE: tl.constexpr, KB: tl.constexpr,
               BLOCKS: tl.constexpr):
    """Pointers to the scales of weight rows ``rows`` (in range) of ``expert``: per row [E, N, 1], or with block
    scales each row's first 128-column scale (per row and 128 columns, or per 128 x 128 tile)."""
    if BLOCKS:
        return s_ptr + (expert.to(tl.int64) * SCALE_ROWS + rows // ROWS_PER_SCALE) * KB
    return s_ptr + expert.to(tl.int64) * SCALE_ROWS + rows


@triton.jit(do_not_specialize=["P"])
def up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, h_ptr, P, H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr,
              GELU: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, BLOCKS: tl.constexpr,
              SCALE_ROWS: tl.constexpr, ROWS_PER_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, NUM_STAGES: tl.constexpr):
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    count = pair_count(ids_ptr, P, expert, BLOCK_P)
    # The weight block as the product's right operand [BLOCK_K, BLOCK_N]: gate rows `cols`, then the up rows.
    gate_w = w_ptr + expert.to(tl.int64) * (2 * INTER * H) + cols[None, :].to(tl.int64) * H
    up_w = gate_w + INTER * H
    KB: tl.constexpr = (H + 127) // 128
    rows = tl.minimum(cols, INTER - 1)  # scale pointers stay in range past the last row
    gate_s = row_scales(s_ptr, expert, rows, SCALE_ROWS, ROWS_PER_SCALE, KB, BLOCKS)
    up_s = row_scales(s_ptr, expert, INTER + rows, SCALE_ROWS, ROWS_PER_SCALE, KB, BLOCKS)
    for first in tl.range(0, count, BLOCK_M):
        pairs, ok = pair_rows(ids_ptr, P, expert, first, count, BLOCK_M, BLOCK_P)
        x_rows = x_ptr + (pairs // K)[:, None] * H
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            a = tl.load(x_rows + ks[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & col_ok[None, :]
            gate = product(gate, a, tl.load(gate_w + ks[:, None], mask=w_ok, other=0.0), gate_s, k0, IEEE, FP8,
                           BLOCKS)
            up = product(up, a, tl.load(up_w + ks[:, None], mask=w_ok, other=0.0), up_s, k0, IEEE, FP8, BLOCKS)
        if FP8 and not BLOCKS:  # one scale per weight row: it factors out of the row's sum
            gate *= tl.load(gate_s)[None, :]
            up *= tl.load(up_s)[None, :]
        if GELU:  # tanh approximation, tanh(y) written as 1 - 2 / (exp(2y) + 1)
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
        else:
            act = gate / (1.0 + tl.exp(-gate))
        tl.store(h_ptr + pairs[:, None] * INTER + cols[None, :], (act * up).to(h_ptr.dtype.element_ty),
                 mask=ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["P"])
def down_kernel(h_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, part_ptr, P, H: tl.constexpr, INTER: tl.constexpr,
                IEEE: tl.constexpr, FP8: tl.constexpr, BLOCKS: tl.constexpr, SCALE_ROWS: tl.constexpr,
                ROWS_PER_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_P: tl.constexpr, NUM_STAGES: tl.constexpr):
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    count = pair_count(ids_ptr, P, expert, BLOCK_P)
    down_w = w_ptr + expert.to(tl.int64) * (H * INTER) + cols[None, :].to(tl.int64) * INTER
    KB: tl.constexpr = (INTER + 127) // 128
    scales = row_scales(s_ptr, expert, tl.minimum(cols, H - 1), SCALE_ROWS, ROWS_PER_SCALE, KB, BLOCKS)
    for first in tl.range(0, count, BLOCK_M):
        pairs, ok = pair_rows(ids_ptr, P, expert, first, count, BLOCK_M, BLOCK_P)
        h_rows = h_ptr + pairs[:, None] * INTER
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(0, INTER, BLOCK_K, num_stages=NUM_STAGES):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < INTER
            a = tl.load(h_rows + ks[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(down_w + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = product(acc, a, b, scales, k0, IEEE, FP8, BLOCKS)
        if FP8 and not BLOCKS:
            acc *= tl.load(scales)[None, :]
        acc *= tl.load(weights_ptr + pairs, mask=ok, other=0.0).to(tl.float32)[:, None]
        tl.store(part_ptr + pairs[:, None] * H + cols[None, :], acc, mask=ok[:, None] & col_ok[None, :])
