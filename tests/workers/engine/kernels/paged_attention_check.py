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


def naive(q: Tensor, cache: Tensor, table: list[int], seq_len: int, scale: float) -> Tensor:
    """q [Hq, D] over the first seq_len keys of one sequence's blocks, float64."""
    block_size, hkv = cache.shape[2], cache.shape[3]
    slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
    flat = cache.view(2, -1, hkv, cache.shape[-1]).double()
    group = q.shape[0] // hkv
    k = flat[0, slots].repeat_interleave(group, dim=1)
    v = flat[1, slots].repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,khd->hk", q.double(), k) * scale
    return torch.einsum("hk,khd->hd", scores.softmax(-1), v)


def check_kernel(hq: int, hkv: int, d: int, block_size: int, seq_lens: list[int], width: int, seed: int) -> float:
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
        width * block_size,
    )
    worst = 0.0
    for i, n in enumerate(seq_lens):
        expected = naive(q[i], cache, tables[i], n, scale)
        worst = max(worst, (out[i].double() - expected).abs().max().item())
    return worst


def check_backend(seed: int) -> float:
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
    expected = SdpaBackend().forward(q, k, v, ref_cache, meta, d**-0.5)
    out = PaddedDecodeBackend().forward(q, k, v, cache_out, padded, d**-0.5)
    assert torch.equal(cache_out, ref_cache), "the backend must write this step's K/V into the same slots"
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
        # Blocks of 128 (`glimpse serve` on CUDA): two key tiles per block, sequences ending inside either.
        "bs128": check_kernel(14, 2, 32, 128, [1, 64, 65, 200, 256], 3, 4),
        "padded_backend": check_backend(3),
    }
    for name, err in cases.items():
        print(f"{name}: max abs error {err:.2e}")
        assert err < 1e-5, name
    # The start-up probe passes here, and a kernel that fails switches itself off for the process.
    assert paged_attention.probe(torch.device("cpu"), torch.float32, 14, 2, 80)

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("no C compiler")

    paged_attention.paged_decode = broken  # type: ignore[assignment]
    assert not paged_attention.probe(torch.device("cpu"), torch.float32, 14, 2, 80)
    assert not paged_attention.triton_available() and not paged_attention.usable(torch.zeros(1, 14, 80))
    print("ok")


if __name__ == "__main__":
    main()
