"""Run under ``TRITON_INTERPRET=1`` by test_paged_attention.py: the Triton paged decode kernels, executed by
Triton's CPU interpreter, against an explicit float64 softmax over keys read through the block tables.

A separate process because Triton reads TRITON_INTERPRET when ``triton.language`` is imported."""

from __future__ import annotations

import os
import random

import torch
from torch import Tensor

from workers.engine.kernels import paged_attention
from workers.engine.kernels.attention import build_attention_metadata
from workers.engine.kernels.torch_attention import PaddedDecodeBackend, SdpaBackend


def naive(q: Tensor, cache: Tensor, table: list[int], seq_len: int, scale: float, window: int = 0) -> Tensor:
    """q [Hq, D] over the first seq_len keys of one sequence's blocks (the last ``window`` of them), float64."""
    block_size, hkv = cache.shape[2], cache.shape[3]
    first = max(0, seq_len - window) if window else 0
    slots = [table[p // block_size] * block_size + p % block_size for p in range(first, seq_len)]
    flat = cache.view(2, -1, hkv, cache.shape[-1]).double()
    group = q.shape[0] // hkv
    k = flat[0, slots].repeat_interleave(group, dim=1)
    v = flat[1, slots].repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,khd->hk", q.double(), k) * scale
    return torch.einsum("hk,khd->hd", scores.softmax(-1), v)


def check_kernel(
    hq: int, hkv: int, d: int, block_size: int, seq_lens: list[int], width: int, seed: int, window: int = 0
) -> float:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = len(seq_lens) * width + 1
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(width)] for _ in seq_lens]  # padded: blocks past the end are live data
    q = torch.randn(len(seq_lens), hq, d, generator=gen)
    scale = d**-0.5
    out = paged_attention.paged_decode(
        q, cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), scale,
        width * block_size, window=window,
    )
    worst = 0.0
    for i, n in enumerate(seq_lens):
        expected = naive(q[i], cache, tables[i], n, scale, window)
        worst = max(worst, (out[i].double() - expected).abs().max().item())
    return worst


def check_combine_chunks(seed: int) -> float:
    """The combine kernel reading the splits two at a time (COMBINE_CHUNK lowered), so grids of more splits than a
    chunk count their live splits: three splits (the last chunk half masked), a sequence whose later splits saw no
    keys, eight splits of which the last two are past the end, and a row with no key at all (zeros, not NaN)."""
    chunk, paged_attention.COMBINE_CHUNK = paged_attention.COMBINE_CHUNK, 2
    try:
        return max(check_kernel(4, 1, 32, 16, [300, 70], 20, seed), check_kernel(4, 1, 32, 16, [700], 64, seed + 1),
                   check_kernel(4, 1, 32, 16, [0, 130], 20, seed + 2))
    finally:
        paged_attention.COMBINE_CHUNK = chunk


def check_backend(seed: int, window: int = 0) -> float:
    """PaddedDecodeBackend (the CUDA-graph decode) takes the kernel here; it must equal the SDPA backend
    and write the same slots, with padding blocks full of huge values."""
    hq, hkv, d, block_size = 6, 2, 16, 4
    gen = torch.Generator().manual_seed(seed)
    seq_lens, width, scratch, num_blocks = [1, 5, 8, 13, 4], 5, 63, 64
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen)
    cache[:, scratch] = 1e4
    free = list(range(scratch))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    q = torch.randn(len(seq_lens), hq, d, generator=gen)
    k, v = torch.randn(2, len(seq_lens), hkv, d, generator=gen)
    meta = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, block_size)
    padded = build_attention_metadata(
        [1] * len(seq_lens), seq_lens, [t + [scratch] * (width - len(t)) for t in tables], block_size
    )
    padded.block_tables = padded.block_tables.long()  # as the CUDA graphs hold it
    ref_cache, cache_out = cache.clone(), cache.clone()
    expected = SdpaBackend().forward(q, k, v, ref_cache, meta, d**-0.5, window)
    out = PaddedDecodeBackend().forward(q, k, v, cache_out, padded, d**-0.5, window)
    assert torch.equal(cache_out, ref_cache), "the backend must write this step's K/V into the same slots"
    return (out - expected).abs().max().item()


def check_split_tokens(seed: int) -> float:
    """A CUDA graph's split length (an input planned for other layers' head count, or too short for the grid) must
    still cover every key: the kernel stretches a split to cover its sequence. A windowed layer ignores it."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d, block_size, width = 4, 1, 16, 16, 32
    seq_lens = [500, 37, 129]
    cache = torch.randn(2, len(seq_lens) * width, block_size, hkv, d, generator=gen)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(len(seq_lens))]
    q = torch.randn(len(seq_lens), hq, d, generator=gen)
    worst = 0.0
    for window in (0, 100):
        out = paged_attention.paged_decode(
            q, cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), 0.25,
            width * block_size, torch.tensor([64], dtype=torch.int32), window,
        )
        for i, n in enumerate(seq_lens):
            worst = max(worst, (out[i].double() - naive(q[i], cache, tables[i], n, 0.25, window)).abs().max().item())
    return worst


def check_flash_mixed_step(seed: int) -> float:
    """FlashVarlenBackend on a mixed step of a sliding layer with images: decode rows through the kernel (with the
    window), the chunks through the varlen contract's reference, then the span rows; against the SDPA backend."""
    from tests.workers.engine.kernels.window_scenarios import Seq, cpu_flash_backend, make_step

    step = make_step([Seq(20, 1), Seq(3, 1), Seq(5, 9, ((7, 12),)), Seq(8, 8, ((5, 12),))], seed=seed)
    expected = SdpaBackend().forward(step.q, step.k, step.v, step.cache.clone(), step.meta, 0.25, 4, True)
    out = cpu_flash_backend().forward(step.q, step.k, step.v, step.cache, step.meta, 0.25, 4, True)
    assert step.meta.derived["decode_prefix"] == 2
    return (out - expected).abs().max().item()


def check_flash_wide_heads(seed: int, window: int = 0) -> float:
    """FlashVarlenBackend on heads its kernels cannot take (512 wide, Gemma 4's global layers): the leading decode
    rows through the paged kernel, the chunks (one cutting an image span) through SDPA; against the SDPA backend."""
    from tests.workers.engine.kernels.window_scenarios import Seq, cpu_flash_backend, make_step

    step = make_step([Seq(20, 1), Seq(37, 1), Seq(5, 9, ((7, 12),)), Seq(0, 6)], d=512, seed=seed)
    backend = cpu_flash_backend()
    backend.supports = lambda q: q.shape[-1] <= 256  # type: ignore[method-assign]
    expected = SdpaBackend().forward(step.q, step.k, step.v, step.cache.clone(), step.meta, 0.05, window, True)
    out = backend.forward(step.q, step.k, step.v, step.cache, step.meta, 0.05, window, True)
    assert step.meta.derived["leading_decodes"] == 2
    return (out - expected).abs().max().item()


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert paged_attention.usable(torch.zeros(1, 1, 16)), "the interpreter should make the kernel usable on CPU"
    cases = {
        # Qwen2.5-VL-7B's grouping (7 query heads per KV head), head_dim 80 (not a power of two).
        "gqa7_d80": check_kernel(14, 2, 80, 16, [1, 15, 16, 17, 100], 8, 0),
        # One long sequence: several splits, and splits past its end (width > length).
        "splits": check_kernel(4, 1, 32, 16, [700], 64, 1),
        "mha_bs4": check_kernel(2, 2, 16, 4, [3, 9, 33], 12, 2),
        # A row with no key (one chunk of splits, none of them live): zeros, as the gather path gives.
        "no_keys": check_kernel(4, 1, 32, 16, [0, 37], 4, 15),
        "combine_chunks": check_combine_chunks(14),
        # Blocks of 128 (`glimpse serve` on CUDA): two key tiles per block, sequences ending inside either.
        "bs128": check_kernel(14, 2, 32, 128, [1, 64, 65, 200, 256], 3, 4),
        "padded_backend": check_backend(3),
        # Sliding windows: the splits cover only each sequence's last `window` keys, starting inside a block.
        "window_splits": check_kernel(4, 1, 32, 16, [700, 5, 130], 64, 5, window=200),
        "window_bs4": check_kernel(2, 2, 16, 4, [3, 9, 33], 12, 6, window=7),
        "window_padded_backend": check_backend(7, window=3),
        "window_graph_split": check_split_tokens(8),
        # Gemma 4's global heads (512 wide: half-length key tiles), GQA 8, a sequence over several splits.
        "wide_d512": check_kernel(8, 1, 512, 16, [1, 40, 300], 20, 10),
        "wide_d512_window": check_kernel(4, 2, 512, 16, [300, 17], 20, 11, window=50),
        "flash_wide_heads": check_flash_wide_heads(12),
        "flash_wide_heads_window": check_flash_wide_heads(13, window=4),
        "flash_mixed_step": check_flash_mixed_step(9),
    }
    for name, err in cases.items():
        print(f"{name}: max abs error {err:.2e}")
        assert err < 1e-5, name
    # The start-up probe passes here, and a kernel that fails switches itself off for the process.
    assert paged_attention.probe(torch.device("cpu"), torch.float32, 14, 2, 80)
    assert paged_attention.probe(torch.device("cpu"), torch.float32, 8, 2, 32, sliding=True)
    assert paged_attention.probe(torch.device("cpu"), torch.float32, 8, 1, 512)
    assert not paged_attention.usable(torch.zeros(1, 8, 1024)), "no head dim over MAX_HEAD_DIM"

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("no C compiler")

    paged_attention.paged_decode = broken  # type: ignore[assignment]
    assert not paged_attention.probe(torch.device("cpu"), torch.float32, 8, 1, 512)
    assert paged_attention.triton_available(), "a wide head's failure leaves the kernel on for the narrower heads"
    assert not paged_attention.probe(torch.device("cpu"), torch.float32, 14, 2, 80)
    assert not paged_attention.triton_available() and not paged_attention.usable(torch.zeros(1, 14, 80))
    print("ok")


if __name__ == "__main__":
    main()
