"""The Triton KV-cache write (the CUDA path of write_kv_cache) checked on the CPU through Triton's
interpreter, bit for bit against the index_copy_ it replaces."""

from __future__ import annotations

from tests.workers.engine.kernels.kernel_check import run_kernel_check

CHECK = """
import torch
from workers.engine.kernels import kv_write_kernel

gen = torch.Generator().manual_seed(0)
# (tokens, kv heads, head dim, blocks, block size): a decode row, a chunk, a row of 2 x 80 (not a power of two)
for tokens, heads, dim, blocks, bs in ((1, 4, 128, 3, 16), (37, 2, 64, 5, 16), (6, 2, 80, 2, 8)):
    for dtype in (torch.bfloat16, torch.float32):
        # K a packed tensor, V a strided view of a wider qkv row, as the decoder's split leaves them
        k = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
        qkv = torch.randn(tokens, 3 * heads * dim + 8, generator=gen).to(dtype)
        v = qkv[:, 8 + heads * dim : 8 + 2 * heads * dim].view(tokens, heads, dim)
        slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
        cache = torch.randn(2, blocks, bs, heads, dim, generator=gen).to(dtype)
        want = cache.clone()
        flat = want.view(2, -1, heads, dim)
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)
        assert kv_write_kernel.usable(k, v, cache)
        kv_write_kernel.write(k, v, cache, slots)
        assert torch.equal(cache, want), (tokens, heads, dim, dtype)
# Heads that are not packed (a transposed view) are not taken.
odd = torch.randn(4, 64, 2).transpose(1, 2)
assert not kv_write_kernel.usable(odd, odd, torch.zeros(2, 1, 4, 2, 64))
"""


def test_kernel_writes_what_index_copy_writes() -> None:
    run_kernel_check(CHECK, "kv_write_kernel", "bfloat16")
