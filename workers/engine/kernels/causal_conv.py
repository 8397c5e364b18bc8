"""Gated DeltaNet's causal depthwise conv over a step's new tokens in one Triton kernel that reads each sequence's
window from the conv-state pool in place.

The torch path (gated_delta.causal_conv1d) lays every sequence out as [its window; its new tokens] in a float32
copy, runs one grouped conv1d over it and gathers the rows back: on a Qwen3.5-27B prefill step (H200, 8 fresh prompts
in 4,096-token chunks, `python -m benchmarks.engine.decode_profile --shape qwen3.5-27b --layers 32 --phase prefill
--batch 8 --context 2200`) cuDNN's generic depthwise kernel took 11.1 ms of a 199 ms step and the copies, gathers,
casts and SiLU around it about 20 ms more, for 24 layers whose inputs are 4,096 x 10,240 values each.

Here each program walks BLOCK_T consecutive rows of BLOCK_C channels, keeping the K-1 inputs before the current row
in registers, so every input row is read once: it sums the taps in float32, applies SiLU and stores the row in x's
dtype. A row whose taps reach before its sequence's first new token takes those taps from the window column of the
sequence's slot instead (zeros without initial state, without reading the slot: it may hold NaN from an earlier
owner). A second kernel then writes each sequence's window after its last new token into its slot (K-1 input rows, or
for a sequence of fewer new tokens the rest of its old window): where the torch ops it replaced (gathers, a where, an
index_copy_) took ~40 us a layer beside the conv's 33 us on the 9B's 2,048-token step (H200). The windows after the
snapshot points (prefix caching) are copied in torch.

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
from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels.attention import StateMetadata, sequence_of_rows
from workers.engine.kernels.triton_switch import TritonSwitch

SWITCH = TritonSwitch("GLIMPSE_TRITON_CONV")
available = SWITCH.on

# A program walks BLOCK_T rows of BLOCK_C channels with the last K-1 input rows in registers, so each input row is
# read once (and K-1 halo rows a program). 32 x 128 on one warp measured best of 16 tilings (H200, graph-timed, the 9B's
# 2,048 x 8,192 conv: 33 us; 2 x 2,048 tokens 62 us; the 27B's 4,096 x 10,240 82 us). The kernel before it, a
# [32, 128] tile loading each tap's rows again with 64-bit addresses per element, took 88, 166 and 209 us.
BLOCK_T, BLOCK_C, NUM_WARPS = 32, 128, 1
MAX_KERNEL = 4  # taps the kernel keeps in registers (Qwen3.5: 4); wider convs take the torch path

WINDOW_BLOCK_C = 512  # channels a program of the window write-back copies (K-1 values each)

_kernels: tuple[Any, Any] | None = None


def _build() -> Any:
    import triton
    import triton.language as tl

    # A step's token count is any number: specialised (on divisibility by 16) it would compile a second variant in
    # the middle of serving. The rest (channels, strides) is fixed per model and met by the start-up warm-up's steps.
    @triton.jit(do_not_specialize=["tokens"])
    def causal_conv_kernel(
        x, w, bias, y, pool, slots, has_initial, query_start_loc, seq_of,
        tokens, channels, b1, b2, sx, sw, sp_slot, sp_c,
        K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ):  # fmt: skip
        t0 = tl.program_id(0) * BT
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        mc = c < channels
        # The tap d rows back (d = 0: the row itself) is weight column K-1-d; taps a narrower conv lacks weigh 0.
        tap = w + c * sw + (K - 1)
        w0 = tl.load(tap, mask=mc, other=0.0).to(tl.float32)
        w1 = tl.load(tap - 1, mask=mc & (K > 1), other=0.0).to(tl.float32)
        w2 = tl.load(tap - 2, mask=mc & (K > 2), other=0.0).to(tl.float32)
        w3 = tl.load(tap - 3, mask=mc & (K > 3), other=0.0).to(tl.float32)
        if HAS_BIAS:
            bv = tl.load(bias + c, mask=mc, other=0.0).to(tl.float32)
        else:
            bv = tl.zeros([BC], dtype=tl.float32)
        # y holds the sections [0, b1), [b1, b2), [b2, channels) one after another, each [tokens, its width]
        first = tl.where(c >= b2, b2, tl.where(c >= b1, b1, 0))
        width = tl.where(c >= b2, channels, tl.where(c >= b1, b2, b1)) - first
        yr = y + first.to(tl.int64) * tokens + (c - first) + t0.to(tl.int64) * width
        xr = x + c + t0.to(tl.int64) * sx
        # The rows 1-3 back of the first row (zeros before row 0); where they belong to an earlier sequence, the
        # fix-up below swaps in the sequence's window.
        h1 = tl.load(xr - sx, mask=mc & (t0 >= 1), other=0.0).to(tl.float32)
        h2 = tl.load(xr - 2 * sx, mask=mc & (t0 >= 2), other=0.0).to(tl.float32)
        h3 = tl.load(xr - 3 * sx, mask=mc & (t0 >= 3), other=0.0).to(tl.float32)
        for t in range(t0, tl.minimum(t0 + BT, tokens)):
            xv = tl.load(xr, mask=mc, other=0.0).to(tl.float32)
            b = tl.load(seq_of + t)
            s = tl.load(query_start_loc + b)
            a1 = h1
            a2 = h2
            a3 = h3
            if t - s < K - 1:  # a tap reaches before the sequence's first new token: its window column
                init = tl.load(has_initial + b) != 0  # without state zeros, the slot unread (it may hold NaN)
                pc = pool + tl.load(slots + b).to(tl.int64) * sp_slot + c * sp_c + (t - s + K - 1)
                a1 = tl.where(t - 1 >= s, h1, tl.load(pc - 1, mask=mc & init & (t - 1 < s), other=0.0).to(tl.float32))
                a2 = tl.where(t - 2 >= s, h2, tl.load(pc - 2, mask=mc & init & (t - 2 < s) & (K > 2), other=0.0).to(tl.float32))
                a3 = tl.where(t - 3 >= s, h3, tl.load(pc - 3, mask=mc & init & (t - 3 < s) & (K > 3), other=0.0).to(tl.float32))
            acc = xv * w0 + a1 * w1 + a2 * w2 + a3 * w3 + bv
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            tl.store(yr, acc.to(y.dtype.element_ty), mask=mc)
            h3 = h2
            h2 = h1
            h1 = xv
            xr += sx
            yr += width

    @triton.jit
    def conv_window_kernel(
        x, pool, slots, has_initial, query_start_loc, channels, sx, sp_slot, sp_c, K: tl.constexpr, BC: tl.constexpr
    ):  # fmt: skip
        """Sequence b's window after its last new token into its slot: column j holds input row end - (K-1) + j,
        from x, or for a sequence of fewer than K-1 new tokens from its old window (zeros without state)."""
        b = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        mc = c < channels
        start = tl.load(query_start_loc + b).to(tl.int64)
        end = tl.load(query_start_loc + b + 1).to(tl.int64)
        init = tl.load(has_initial + b) != 0
        pc = pool + tl.load(slots + b).to(tl.int64) * sp_slot + c * sp_c
        for j in tl.static_range(K - 1):
            row = end - (K - 1) + j
            if row >= start:
                v = tl.load(x + row * sx + c, mask=mc, other=0.0)
            else:  # the old window's column row - start + K-1 = j + (new tokens) > j: not yet overwritten
                v = tl.load(pc + (row - start + K - 1), mask=mc & init, other=0.0)
            tl.store(pc + j, v.to(pool.dtype.element_ty), mask=mc)

    return causal_conv_kernel, conv_window_kernel


def conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, st: StateMetadata, query_start_loc: Tensor,
    starts_cpu: list[int], silu: bool, seq_of: Tensor | None = None,
) -> Tensor:
    """x [T, C] (rows may be strided), the step's sequences one after another (``query_start_loc`` [B+1] int32 on the
    device, ``starts_cpu`` its first B entries on the host); weight [C, K]; conv_state [S, C, K-1] with sequence b's
    window in slot ``st.slots[b]``. Returns the (SiLU'd) conv [T, C] in x's dtype; the window after each sequence's
    last new token is written back to its slot, and the one after its first n to each snapshot slot of
    ``st.snapshots``. ``seq_of`` [T]: each row's sequence index (made here when not given)."""
    return conv_sections(x, weight, bias, conv_state, st, query_start_loc, starts_cpu, silu, [x.shape[1]], seq_of)[0]


def conv_sections(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, st: StateMetadata, query_start_loc: Tensor,
    starts_cpu: list[int], silu: bool, sections: Sequence[int], seq_of: Tensor | None = None,
) -> list[Tensor]:
    """``conv`` with its output as consecutive channel ``sections`` (at most three widths summing to C), each a
    contiguous [T, width] tensor: the conv's [T, C] split by channels, without the row stride of C."""
    global _kernels
    if _kernels is None:
        _kernels = _build()
    conv_kernel, window_kernel = _kernels
    tokens, channels = x.shape
    width = weight.shape[1] - 1
    if not takes(width + 1):
        raise ValueError(f"conv kernel width {width + 1}: the Triton kernel takes 1-{MAX_KERNEL} taps")
    x, weight = operands(x, weight, conv_state)
    if seq_of is None:
        seq_of = sequence_of_rows(query_start_loc, tokens)
    # A snapshot after fewer than K-1 new tokens reaches into the sequence's old window: gathered before the
    # write-back below replaces it (zeros where it has no state; the slot may hold garbage).
    windows = st.initial(conv_state) if any(n < width for _, n, _ in st.snapshots) else None
    bounds = _bounds(sections, channels)
    y = torch.empty(tokens * channels, dtype=x.dtype, device=x.device)
    grid = (-(-tokens // BLOCK_T), -(-channels // BLOCK_C))
    conv_kernel[grid](
        x, weight, bias if bias is not None else weight, y, conv_state, st.slots, st.has_initial, query_start_loc,
        seq_of, tokens, channels, bounds[1], bounds[2], x.stride(0), weight.stride(0), conv_state.stride(0),
        conv_state.stride(1), K=width + 1, BT=BLOCK_T, BC=BLOCK_C, HAS_BIAS=bias is not None, SILU=silu,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    for b, n, slot in st.snapshots:  # the window after sequence b's first n new tokens
        end = starts_cpu[b] + n
        if n >= width:
            conv_state[slot].copy_(x[end - width : end].t())
        else:
            assert windows is not None
            conv_state[slot].copy_(torch.cat([windows[b, :, n:], x[end - n : end].t().to(windows.dtype)], dim=1))
    # Launched after the conv, which reads the old windows; one program per sequence and channel block.
    window_kernel[(st.slots.shape[0], -(-channels // WINDOW_BLOCK_C))](
        x, conv_state, st.slots, st.has_initial, query_start_loc, channels, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), K=width + 1, BC=WINDOW_BLOCK_C, num_warps=4,
    )  # fmt: skip
    return [y[a * tokens : b * tokens].view(tokens, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]


def takes(kernel: int) -> bool:
    """Whether the kernel takes a conv of ``kernel`` taps (it keeps the last MAX_KERNEL - 1 inputs in registers)."""
    return 1 <= kernel <= MAX_KERNEL


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
