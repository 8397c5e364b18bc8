"""Gated DeltaNet's causal depthwise conv over a step's new tokens in one Triton kernel that reads each sequence's
window from the conv-state pool in place.

The torch path (gated_delta.causal_conv1d) lays every sequence out as [its window; its new tokens] in a float32
copy, runs one grouped conv1d over it and gathers the rows back: on a Qwen3.5-27B prefill step (H200, 8 fresh prompts
in 4,096-token chunks, `python -m benchmarks.engine.decode_profile --shape qwen3.5-27b --layers 32 --phase prefill
--batch 8 --context 2200`) cuDNN's generic depthwise kernel took 11.1 ms of a 199 ms step and the copies, gathers,
casts and SiLU around it about 20 ms more, for 24 layers whose inputs are 4,096 x 10,240 values each.

Here each program takes BLOCK_T tokens x BLOCK_C channels of the step: for every tap it loads the input row that
tap reads, or, for a sequence's first K-1 tokens, the window column from the sequence's slot (zeros without
initial state, without reading the slot: it may hold NaN from an earlier owner), sums the taps in float32, applies
SiLU and stores the output in x's dtype. The windows after each sequence's last token (and after the snapshot
points) are K-1 rows per sequence, written back afterwards from the input rows and the old windows gathered
before the kernel ran.

The output can be stored as up to three sections of channels, each its own contiguous [T, width] block
(``conv_sections``): Gated DeltaNet's q, k and v, which fla's chunked kernels take contiguous. As one [T, C] tensor
split by channels they were views with a row stride of C, so fla's input guard copied each of them again: three copy
kernels a layer, 72 of a Qwen3.5-9B prefill step's 155 generic elementwise launches (H200 profile, docs/perf-notes.md).

The CPU keeps the torch path, which the exactness tests compare with transformers; on CUDA the start-up probe checks
this kernel once against a float32 reference of its own (``reference``, tied to the torch path by a test), and a
failure leaves the torch path serving (``GLIMPSE_TRITON_CONV=0`` turns the kernel off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels.attention import StateMetadata, sequence_of_rows
from workers.engine.kernels.triton_switch import TritonSwitch

SWITCH = TritonSwitch("GLIMPSE_TRITON_CONV")
available = SWITCH.on

# 32 tokens x 128 channels a program: each tap's load is 32 rows of 256 contiguous bytes (bf16), and the four taps
# of a tile re-read mostly the same rows (cache hits), so the kernel streams x and y about once.
BLOCK_T, BLOCK_C = 32, 128

_kernel: Any = None


def _build() -> Any:
    import triton
    import triton.language as tl

    # A step's token count is any number: specialised (on divisibility by 16) it would compile a second variant in
    # the middle of serving. The rest (channels, strides) is fixed per model and met by the start-up warm-up's steps.
    @triton.jit(do_not_specialize=["tokens"])
    def causal_conv_kernel(
        x, w, bias, y, pool, slots, has_initial, starts, seq_of,
        tokens, channels, b1, b2, sx, sw, sp_slot, sp_c,
        K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        mt = t < tokens
        mc = c < channels
        b = tl.load(seq_of + t, mask=mt, other=0)
        start = tl.load(starts + b, mask=mt, other=0)
        slot = tl.load(slots + b, mask=mt, other=0).to(tl.int64)
        init = tl.load(has_initial + b, mask=mt, other=0) != 0
        m = mt[:, None] & mc[None, :]
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(K):
            src = t - (K - 1) + j
            inside = src >= start
            xv = tl.load(x + src.to(tl.int64)[:, None] * sx + c[None, :], mask=m & inside[:, None], other=0.0)
            col = src - start + (K - 1)  # the window's column this tap reads before the sequence's first new token
            wv = tl.load(pool + slot[:, None] * sp_slot + c[None, :] * sp_c + col[:, None],
                         mask=m & (init & ~inside)[:, None], other=0.0)  # fmt: skip
            tap = tl.load(w + c * sw + j, mask=mc, other=0.0).to(tl.float32)
            acc += (xv.to(tl.float32) + wv.to(tl.float32)) * tap[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + c, mask=mc, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        # y holds the sections [0, b1), [b1, b2), [b2, channels) one after another, each [tokens, its width]
        first = tl.where(c >= b2, b2, tl.where(c >= b1, b1, 0))
        width = tl.where(c >= b2, channels, tl.where(c >= b1, b2, b1)) - first
        at = first.to(tl.int64)[None, :] * tokens + t.to(tl.int64)[:, None] * width[None, :] + (c - first)[None, :]
        tl.store(y + at, acc.to(y.dtype.element_ty), mask=m)

    return causal_conv_kernel


@dataclass(frozen=True)
class WindowPlan:
    """Where each sequence's window after its last new token comes from, for a conv of K-1 = ``width`` taps of
    history: the same for every layer of a step, so a step builds it once (about a dozen small ops a layer
    otherwise, on a host that launches each Gated DeltaNet layer eagerly)."""

    width: int
    starts: Tensor  # [B] int64: each sequence's first row in the step
    rows: Tensor  # [B, K-1] the rows end_b - (K-1) .. end_b - 1, clamped to 0 (read from x where ``inside``)
    inside: Tensor  # [B, K-1, 1] whether that row is one of the sequence's new tokens
    cols: Tensor  # [B, 1, K-1] else its column in the old window (row - start_b + K-1), clamped into the window


def window_plan(query_start_loc: Tensor, width: int) -> WindowPlan:
    """The WindowPlan of a step whose sequences start at ``query_start_loc`` [B+1] (device; no host sync)."""
    starts = query_start_loc[:-1].long()
    span = torch.arange(width, device=query_start_loc.device)
    rows = query_start_loc[1:].long().unsqueeze(1) - width + span  # [B, K-1]
    inside = rows >= starts.unsqueeze(1)
    cols = (rows - starts.unsqueeze(1) + width).clamp(0, width - 1)
    return WindowPlan(width, starts, rows.clamp(min=0), inside.unsqueeze(-1), cols.unsqueeze(1))


def conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, st: StateMetadata, query_start_loc: Tensor,
    starts_cpu: list[int], silu: bool, seq_of: Tensor | None = None, plan: WindowPlan | None = None,
) -> Tensor:
    """x [T, C] (rows may be strided), the step's sequences one after another (``query_start_loc`` [B+1] on the
    device, ``starts_cpu`` its first B entries on the host); weight [C, K]; conv_state [S, C, K-1] with sequence b's
    window in slot ``st.slots[b]``. Returns the (SiLU'd) conv [T, C] in x's dtype; the window after each sequence's
    last new token is written back to its slot, and the one after its first n to each snapshot slot of
    ``st.snapshots``. ``seq_of`` [T]: each row's sequence index, and ``plan`` the step's window_plan (each made here
    when not given)."""
    return conv_sections(x, weight, bias, conv_state, st, query_start_loc, starts_cpu, silu, [x.shape[1]], seq_of,
                         plan)[0]  # fmt: skip


def conv_sections(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, st: StateMetadata, query_start_loc: Tensor,
    starts_cpu: list[int], silu: bool, sections: Sequence[int], seq_of: Tensor | None = None,
    plan: WindowPlan | None = None,
) -> list[Tensor]:
    """``conv`` with its output as consecutive channel ``sections`` (at most three widths summing to C), each a
    contiguous [T, width] tensor: the conv's [T, C] split by channels, without the row stride of C."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    tokens, channels = x.shape
    width = weight.shape[1] - 1
    x, weight = operands(x, weight, conv_state)
    device = x.device
    if plan is None or plan.width != width:
        plan = window_plan(query_start_loc, width)
    if seq_of is None:
        seq_of = sequence_of_rows(query_start_loc, tokens)
    # The old windows, before anything writes the pool: the write-back below reaches into them where a sequence has
    # fewer than K-1 new tokens (zeros where it has no state; the slot may hold garbage).
    windows = st.initial(conv_state)  # [B, C, K-1]
    bounds = _bounds(sections, channels)
    y = torch.empty(tokens * channels, dtype=x.dtype, device=device)
    grid = (-(-tokens // BLOCK_T), -(-channels // BLOCK_C))
    _kernel[grid](
        x, weight, bias if bias is not None else weight, y, conv_state, st.slots, st.has_initial, plan.starts, seq_of,
        tokens, channels, bounds[1], bounds[2], x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1),
        K=width + 1, BT=BLOCK_T, BC=BLOCK_C, HAS_BIAS=bias is not None, SILU=silu, num_warps=4,
    )  # fmt: skip
    # Sequence b's window after its last new token: from x where its rows are new tokens, else from its old window.
    from_x = x[plan.rows]  # [B, K-1, C]
    from_window = windows.gather(2, plan.cols.expand(-1, channels, -1)).transpose(1, 2)
    after = torch.where(plan.inside, from_x.to(windows.dtype), from_window)
    for b, n, slot in st.snapshots:  # the window after sequence b's first n new tokens
        end = starts_cpu[b] + n
        if n >= width:
            conv_state[slot].copy_(x[end - width : end].t())
        else:
            conv_state[slot].copy_(torch.cat([windows[b, :, n:], x[end - n : end].t().to(windows.dtype)], dim=1))
    conv_state.index_copy_(0, st.slots, after.transpose(1, 2).to(conv_state.dtype))
    return [y[a * tokens : b * tokens].view(tokens, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]


def operands(x: Tensor, weight: Tensor, conv_state: Tensor) -> tuple[Tensor, Tensor]:
    """x and weight as the conv kernels (this one and conv_decode.py's) take them: x's channels and a channel's taps at
    unit stride (copied where not); the pool's windows must be contiguous along the taps (a pool is never copied)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if conv_state.stride(-1) != 1:
        raise ValueError("the conv-state pool's windows must be contiguous along the taps")
    return x, weight


def _bounds(sections: Sequence[int], channels: int) -> list[int]:
    """[0, b1, b2, C]: the kernel's two section boundaries (equal to C where there are fewer sections)."""
    if not 1 <= len(sections) <= 3 or sum(sections) != channels or min(sections) <= 0:
        raise ValueError(f"conv sections {list(sections)}: expected 1-3 positive widths summing to {channels}")
    bounds = [0]
    for width in sections:
        bounds.append(bounds[-1] + width)
    return bounds + [channels] * (4 - len(bounds))


def reference(
    x: Tensor, weight: Tensor, bias: Tensor | None, pool: Tensor, lens: list[int], slots: list[int],
    has_initial: list[bool], silu: bool,
) -> tuple[Tensor, Tensor]:
    """The conv in float32 torch, one sequence at a time ([window; tokens] times the taps), and the pool after it
    (each sequence's last K-1 inputs in its slot): the probe's reference, independent of the kernel's tiling."""
    width = weight.shape[1] - 1
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    pool = pool.clone()
    start = 0
    for n, slot, init in zip(lens, slots, has_initial, strict=True):
        window = pool[slot].float() if init else torch.zeros(pool.shape[1:], device=pool.device)
        field = torch.cat([window, x[start : start + n].float().t()], dim=1)  # [C, K-1+n]
        for i in range(n):
            out[start + i] = (field[:, i : i + width + 1] * weight.float()).sum(dim=1)
        if bias is not None:
            out[start : start + n] += bias.float()
        pool[slot] = field[:, -width:].to(pool.dtype)
        start += n
    if silu:
        out = torch.nn.functional.silu(out)
    return out, pool


PROBE_SECTIONS = (40, 40, 56)  # the probe's 136 channels as q, k, v would be: 40 and 80 fall inside the first tile


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once against ``reference`` (3 sequences of 5, 2 and 40 tokens: one without a state whose slot
    holds NaN, one shorter than the window, one over several token tiles; strided input rows; the output in three
    sections, one boundary inside a channel tile); a Triton that cannot compile here or a wrong answer turns it off
    for the process. (On the CPU only under Triton's interpreter, as the tests run it.)"""
    gen = torch.Generator().manual_seed(0)
    lens, slots, has_initial = [5, 2, 40], [3, 1, 0], [True, False, True]
    channels, k = 136, 4  # channels over one tile, and not a multiple of it
    wide = torch.randn(sum(lens), channels + 8, generator=gen)
    x = wide[:, :channels]
    weight = torch.randn(channels, k, generator=gen) * 0.5
    pool = torch.randn(5, channels, k - 1, generator=gen)
    pool[1] = float("nan")
    want, want_pool = reference(x, weight, None, pool, lens, slots, has_initial, True)

    def check() -> bool:
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        dx = wide.to(device=device, dtype=dtype)[:, :channels]
        got_pool = pool.to(device=device, dtype=dtype)
        st = StateMetadata(torch.tensor(slots, device=device), slots, torch.tensor(has_initial, device=device),
                           has_initial)  # fmt: skip
        parts = conv_sections(dx, weight.to(device=device, dtype=dtype), None, got_pool, st,
                              torch.tensor(qsl, dtype=torch.int32, device=device), qsl[:-1], True, PROBE_SECTIONS)
        return agrees(torch.cat(parts, dim=1), got_pool, want, want_pool, slots)

    return SWITCH.probe(check)


def agrees(got: Tensor, got_pool: Tensor, want: Tensor, want_pool: Tensor, slots: list[int]) -> bool:
    """A conv kernel's probe (this one's, conv_decode.py's): its output and the windows it left in ``slots`` against
    ``reference``'s, to rounding in the kernel's dtype."""
    tol = 1e-5 if got.dtype == torch.float32 else 3e-2
    return torch.allclose(got.float().cpu(), want, rtol=tol, atol=tol) and torch.allclose(
        got_pool.float().cpu()[slots], want_pool[slots].float(), rtol=tol, atol=tol
    )
