"""y = x W^T (+ b) for a few rows of x, in Triton: the decode step's projections on CUDA.

A decode step multiplies a handful of rows by every weight of the model, so its floor is the time to stream the
weights once: 14.1 GB for a 7B's projections and LM head, 2.9 ms at an H200's 4.8 TB/s. cuBLAS's kernels for one to
a few dozen rows (nvjet "tst" tiles) streamed the large ones at 3.5-4.0 TB/s (H200, graph-replayed,
`python -m benchmarks.kernels.skinny_gemm_bench`). Here each program streams a [BLOCK_N, K / SPLIT_K] strip of W with pipelined wide loads and
multiplies it on the tensor cores against x padded to BLOCK_M rows (16 at least, the smallest tl.dot), so the
rows cost nothing extra up to BLOCK_M; the accumulation is float32.

A matrix with too few output features to fill the card (a down or o projection: 3,584 rows of W) is split along
K: each split writes a float32 partial and a second pass sums the partials in a fixed order and adds the bias, so
the result is deterministic (no atomics) and does not depend on the batch. Where the next kernel is a residual add
and RMSNorm (o and down projections), that kernel sums the partials itself (``unsummed``, split_norm.py).

Only the CUDA path uses it (``wanted``): the CPU keeps F.linear, whose float32 results the exactness tests compare
with transformers. The row count is a runtime argument that Triton does not specialise on, and up to MAX_ROWS
BLOCK_M is always 16, so a variant compiles once per weight shape; the start-up warm-up (warmup.py) runs every
projection and the LM head at decode row counts, which compiles them all before any CUDA-graph capture.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch import Tensor

from workers.engine.kernels import pdl
from workers.engine.kernels.triton_switch import TritonSwitch

# Where the kernel beat cuBLAS (H200, `python -m benchmarks.kernels.skinny_gemm_bench`): up to 16 rows, on matrices of at
# least 64 MB (gate_up, down and the LM head of a 7B: 3-12% less time). At 64 rows cuBLAS was ahead, and on the
# 25-33 MB qkv and o projections it was ahead or level at every row count.
MAX_ROWS = 16
MIN_WEIGHT_BYTES = 64 << 20
# Part of the key of the tiles measured at start-up (skinny_tune.py): bump it when the kernels change, so that a
# restart measures them again rather than serving choices made for the old code.
KERNEL_VERSION = 2

SWITCH = TritonSwitch("GLIMPSE_TRITON_SKINNY")
available = SWITCH.on


class Tile(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int


# What the start-up measurement (skinny_tune.py) chose per weight shape (out features, in features): a tile, or
# None where cuBLAS was faster. A shape it did not measure takes the fixed rule (MIN_WEIGHT_BYTES, ``tile``).
_measured: dict[tuple[int, int], Tile | None] = {}


def use_measured(n: int, k: int, pick: Tile | None) -> None:
    """Serve [n, k] weights with ``pick`` (None: cuBLAS) from now on; called before any CUDA-graph capture."""
    _measured[(n, k)] = pick


def measured(n: int, k: int) -> tuple[bool, Tile | None]:
    """(whether [n, k] was measured, what it chose)."""
    return (n, k) in _measured, _measured.get((n, k))


def wanted(x: Tensor, weight: Tensor) -> bool:
    """Whether F.linear(x, weight) should take this kernel: CUDA, bf16/fp16, at most MAX_ROWS rows of x, and a
    weight shape measured faster here than cuBLAS (unmeasured: a weight of at least MIN_WEIGHT_BYTES)."""
    if not (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and 0 < x.numel() <= MAX_ROWS * x.shape[-1]
        and available()
    ):
        return False
    known, pick = measured(weight.shape[0], weight.shape[-1])
    return pick is not None if known else weight.numel() * weight.element_size() >= MIN_WEIGHT_BYTES


def block_m(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


def tile(n: int, k: int, sms: int) -> Tile:
    """The fixed rule's tile for a [rows, k] x [k, n] product on a card with ``sms`` multiprocessors (the same for
    any row count up to MAX_ROWS: the weight's stream is the cost); skinny_tune.py measures it against others at
    start-up.

    A weight with output rows for two 32-column strips per SM streams whole rows of K on 2 warps; a narrower weight
    (o, down) splits K until there are ~3 programs per SM. On an H200 at one row (`python -m
    benchmarks.kernels.skinny_gemm_bench --size qwen3.5-27b --sweep 1`) the whole-K strips were within 0.3-1.4% of
    the sweep's best tile on the 27B's in_proj, qkv and gate_up, where the rule before (splitting K below 4 programs
    per SM, 64-column strips on 4 warps for the widest) took 23% longer on the 16,480-row in_proj. Aiming at 4
    programs per SM split Qwen3-VL-8B's 4,096-row down and o projections in 8, 1.20 and 0.54 ms for their 36 layers
    against 1.06 and 0.45 on cuBLAS; 3 keeps them at 4 (the measured tiles split the down in 4: 0.99 ms) and leaves
    the 7B's and the 27B's narrow projections where they were.
    """
    block_n = 32
    if -(-n // block_n) >= 2 * sms:
        return Tile(block_n, 128, 1, 2, 4)
    split = 1
    while -(-n // block_n) * split < 3 * sms and k // (2 * split) >= 512 and k % (2 * split * 128) == 0:
        split *= 2
    return Tile(block_n, 128, split, 4, 4)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["rows"])
    def skinny_gemm_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        rows,
        n,
        k,
        k_split,
        HAS_BIAS: tl.constexpr,
        PARTIAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        k0 = pid_k * k_split
        x_ptrs = x_ptr + offs_m[:, None] * k + (k0 + offs_k)[None, :]
        # W^T's [BLOCK_K, BLOCK_N] tile, read along W's contiguous rows
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * k + (k0 + offs_k)[:, None]
        m_ok = offs_m[:, None] < rows
        n_ok = offs_n[None, :] < n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PDL:
            # Wait for the kernel before, but do not let the next one launch early: its programs, resident beside
            # this kernel's and waiting, made the decode step's GEMM chains slower (Qwen3-VL-8B's down projections
            # 1.25 against 0.94 ms, H200), while launched after this kernel's last program it still overlaps
            # this kernel's drain and flush.
            tl.extra.cuda.gdc_wait()
        for kk in range(0, k_split, BLOCK_K):
            k_ok = k0 + kk + offs_k < k
            x = tl.load(x_ptrs, mask=m_ok & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok & k_ok[:, None], other=0.0)
            acc = tl.dot(x, w, acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if PARTIAL:
            dst = out_ptr + pid_k * rows * n + offs_m[:, None] * n + offs_n[None, :]
            tl.store(dst, acc, mask=m_ok & n_ok)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=offs_n < n, other=0.0).to(tl.float32)[None, :]
            dst = out_ptr + offs_m[:, None] * n + offs_n[None, :]
            tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok & n_ok)

    @triton.jit(do_not_specialize=["rows"])
    def skinny_sum_kernel(
        part_ptr, b_ptr, out_ptr, rows, n, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):  # a fixed order: the sum does not depend on timing
            acc += tl.load(part_ptr + (s * rows + row) * n + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)

    return skinny_gemm_kernel, skinny_sum_kernel


@functools.cache  # read on every call of linear (and w8a16's), outside graphs too
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any count works; an H100's keeps CPU tests on the GPU's tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


class Partials(NamedTuple):
    """A split-K product not summed yet: the float32 partials [split, rows, n], the bias to add after their sum and
    the dtype of the result. The kernel after the GEMM sums them (split_norm.py: the next RMSNorm), so the sum is
    not a kernel of its own; ``settle`` runs the sum pass for any other consumer."""

    parts: Tensor
    bias: Tensor | None
    dtype: torch.dtype

    def settle(self) -> Tensor:
        """The sum, bits as ``linear`` returns it."""
        _, rows, n = self.parts.shape
        out = torch.empty((rows, n), dtype=self.dtype, device=self.parts.device)
        sum_splits(self.parts, self.bias, out)
        return out


def settled(y: Tensor | Partials) -> Tensor:
    """A product as a tensor: partials summed (the sum pass), anything else as it is."""
    return y.settle() if isinstance(y, Partials) else y


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, use: Tile | None = None) -> Tensor:
    """F.linear(x, weight, bias) for x of at most MAX_ROWS rows (any leading shape); ``use`` overrides the
    tile (benchmarks)."""
    lead = x.shape[:-1]
    y = settled(unsummed(x.reshape(-1, x.shape[-1]), weight, bias, use))
    return y.reshape(*lead, weight.shape[0])


def unsummed(x: Tensor, weight: Tensor, bias: Tensor | None = None, use: Tile | None = None) -> Tensor | Partials:
    """``linear`` for x [rows, K], but where the tile splits K the partials are returned unsummed."""
    n, k = weight.shape
    x2 = x.contiguous()
    rows = x2.shape[0]
    t = use or _measured.get((n, k)) or tile(n, k, sm_count(x.device))
    if rows == 0 or t.split_k == 1:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        if rows:
            _launch(x2, weight, bias, out, t)
        return out
    parts = torch.empty((t.split_k, rows, n), dtype=torch.float32, device=x.device)
    _launch(x2, weight, None, parts, t)
    return Partials(parts, bias, x.dtype)


def _launch(x2: Tensor, weight: Tensor, bias: Tensor | None, dst: Tensor, t: Tile) -> None:
    """The GEMM into ``dst``: the result [rows, n], or float32 partials [split, rows, n] when ``t`` splits K."""
    n, k = weight.shape
    rows = x2.shape[0]
    w = weight.contiguous()
    k_split = -(-k // (t.split_k * t.block_k)) * t.block_k
    _kernels()[0][(-(-n // t.block_n), t.split_k)](
        x2, w, bias if bias is not None else w, dst, rows, n, k, k_split, HAS_BIAS=bias is not None,
        PARTIAL=t.split_k > 1, BLOCK_M=block_m(rows), BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.warps,
        num_stages=t.stages, **pdl.launch(x2.device),
    )  # fmt: skip


def sum_splits(parts: Tensor, bias: Tensor | None, out: Tensor) -> None:
    """out [rows, n] = the float32 partials [split, rows, n] summed in a fixed order, plus the bias: the second pass
    of a split-K GEMM (also w8a16_gemm.py's)."""
    split, rows, n = parts.shape
    reduce = _kernels()[1]
    reduce[(rows, -(-n // 1024))](
        parts, bias if bias is not None else parts, out, rows, n, SPLIT=split, HAS_BIAS=bias is not None,
        BLOCK=1024, num_warps=4, **pdl.launch(out.device),
    )  # fmt: skip


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once (plain and split along K) against F.linear; a Triton that cannot compile here or a wrong
    answer turns it off for the process (cuBLAS serves instead) rather than failing mid-serving."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1024, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(96, 1024, generator=gen) / 32).to(device=device, dtype=dtype)
    b = torch.randn(96, generator=gen).to(device=device, dtype=dtype)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())

    def check() -> bool:
        got = [linear(x, w, b, use=Tile(32, 128, s, 4, 2)).float() for s in (1, 4)]
        return all(torch.allclose(g, want, rtol=2e-2, atol=2e-2) for g in got)

    return SWITCH.probe(check)
