"""Gated DeltaNet's causal conv for an all-decode step (one new token per sequence) in one Triton kernel that reads
each sequence's window from the conv-state pool and shifts it in place.

The compiled all-decode conv (fused.conv_decode) is three kernels a layer in the decode graph: Inductor's two (the
windows gathered and cast, the taps summed) and the ``index_copy_`` that writes the windows back. At 64 sequences of
the Qwen3.5-9B shape they took 0.38 ms of a ~9 ms decode step for its 24 layers, ~16 us a layer (H200, a served
(b)'s tail under torch's profiler, docs/benchmarks.md), where the windows, inputs and outputs are ~8 MB a layer,
about 2 us at the card's bandwidth.

Here each program takes one sequence and BLOCK_C channels: it loads the K-1 window columns of its slot (zeros where
the sequence has no initial state, without reading the slot: it may hold NaN from an earlier owner) and the new
input, sums the taps in float32 in the torch path's order, applies SiLU and stores the output in x's dtype; it
shifts the window as it goes (column j-1 takes column j, the last one the input). A program reads each column before
it overwrites it, and no two sequences of a step share a slot (a CUDA-graph bucket's padding rows may share a scratch
slot, whose contents nobody reads). Slots and has-initial flags are read on the device, so the step is CUDA-graph
safe.

The CPU keeps gated_delta.causal_conv1d's torch path, which the exactness tests compare with transformers; on CUDA
the start-up probe checks this kernel once against ``causal_conv.reference`` (a float32 conv one sequence at a time,
tied to the torch path by a test), and a failure leaves the compiled path serving (``GLIMPSE_TRITON_CONV_DECODE=0``
turns the kernel off).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from workers.engine.kernels import causal_conv
from workers.engine.kernels.attention import StateMetadata
from workers.engine.kernels.triton_switch import TritonSwitch

SWITCH = TritonSwitch("GLIMPSE_TRITON_CONV_DECODE")
available = SWITCH.on

# Channels a program takes: 256 over 4 warps, two a thread; the 9B's 8,192 conv channels are 32 programs a sequence.
BLOCK_C = 256

_kernel: Any = None


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def conv_decode_kernel(
        x, w, bias, y, pool, slots, has_initial, channels, sx, sw, sy, sp_slot, sp_c,
        K: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        mc = c < channels
        slot = tl.load(slots + n).to(tl.int64)
        init = tl.load(has_initial + n) != 0
        window = pool + slot * sp_slot + c * sp_c
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(K - 1):  # the window's taps, oldest input first
            wv = tl.load(window + j, mask=mc & init, other=0.0)
            acc += wv.to(tl.float32) * tl.load(w + c * sw + j, mask=mc, other=0.0).to(tl.float32)
            if j > 0:
                tl.store(window + (j - 1), wv, mask=mc)
        xv = tl.load(x + n * sx + c, mask=mc, other=0.0)
        acc += xv.to(tl.float32) * tl.load(w + c * sw + (K - 1), mask=mc, other=0.0).to(tl.float32)
        tl.store(window + (K - 2), xv.to(pool.dtype.element_ty), mask=mc)
        if HAS_BIAS:
            acc += tl.load(bias + c, mask=mc, other=0.0).to(tl.float32)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y + n * sy + c, acc.to(y.dtype.element_ty), mask=mc)

    return conv_decode_kernel


def decode_step(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, st: StateMetadata, silu: bool
) -> Tensor:
    """x [B, C] (row b: sequence b's only new token; rows may be strided), weight [C, K] (K >= 2), bias [C] or None,
    conv_state [S, C, K-1] with sequence b's window in slot ``st.slots[b]``. Returns the (SiLU'd) conv [B, C] in x's
    dtype; each window is shifted in place, and each snapshot slot of ``st.snapshots`` takes its sequence's window
    after the token."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    rows, channels = x.shape
    taps = weight.shape[1]
    if taps < 2:
        raise ValueError(f"a conv of {taps} tap has no window to keep")
    x, weight = causal_conv.operands(x, weight, conv_state)
    y = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    _kernel[(rows, -(-channels // BLOCK_C))](
        x, weight, bias if bias is not None else weight, y, conv_state, st.slots, st.has_initial, channels,
        x.stride(0), weight.stride(0), y.stride(0), conv_state.stride(0), conv_state.stride(1),
        K=taps, BC=BLOCK_C, HAS_BIAS=bias is not None, SILU=silu, num_warps=4,
    )  # fmt: skip
    for b, _, slot in st.snapshots:  # n is 1 in a decode step: the window after the only token
        conv_state[slot].copy_(conv_state[st.slots_cpu[b]])
    return y


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once against ``causal_conv.reference`` (3 sequences, one without a state whose slot holds NaN;
    strided input rows; channels over one block and not a multiple of it; no bias and SiLU, as Qwen3.5 serves it);
    a Triton that cannot compile here or a wrong answer turns it off for the process. (On the CPU only under
    Triton's interpreter, as the tests run it.)"""
    gen = torch.Generator().manual_seed(0)
    slots, has_initial = [3, 1, 0], [True, False, True]
    channels, k = 300, 4
    wide = torch.randn(len(slots), channels + 8, generator=gen)
    weight = torch.randn(channels, k, generator=gen) * 0.5
    pool = torch.randn(5, channels, k - 1, generator=gen)
    pool[1] = float("nan")
    want, want_pool = causal_conv.reference(wide[:, :channels], weight, None, pool, [1] * len(slots), slots,
                                            has_initial, True)  # fmt: skip

    def check() -> bool:
        got_pool = pool.to(device=device, dtype=dtype)
        st = StateMetadata(torch.tensor(slots, device=device), slots, torch.tensor(has_initial, device=device),
                           has_initial)  # fmt: skip
        got = decode_step(wide.to(device=device, dtype=dtype)[:, :channels], weight.to(device=device, dtype=dtype),
                          None, got_pool, st, True)  # fmt: skip
        return causal_conv.agrees(got, got_pool, want, want_pool, slots)

    return SWITCH.probe(check)
