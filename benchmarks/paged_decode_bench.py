"""Decode attention per layer: the padded gather + FlashAttention path against the in-place Triton kernel.

    python -m benchmarks.paged_decode_bench

Qwen2.5-VL-7B shapes (28 query heads, 4 KV heads, head_dim 128, 16-token blocks), bf16, one layer's call as
the CUDA-graph decode makes it (tables padded to a power-of-two width). Prints ms per call and the
effective bandwidth over the live K/V bytes.
"""

from __future__ import annotations

from functools import partial

import torch

from benchmarks.vit_bench import cuda_ms
from workers.engine import paged_attention
from workers.engine.attention import PaddedDecodeBackend, build_attention_metadata

HQ, HKV, D, BS = 28, 4, 128, 16


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| batch | context | width (tokens) | gather + FA (ms) | paged Triton (ms) | speed-up | Triton GB/s |")
    print("|---|---|---|---|---|---|---|")
    for batch, context in ((1, 300), (1, 4000), (1, 20000), (16, 2900), (32, 2900), (64, 2900), (128, 2900)):
        blocks = -(-context // BS)
        width = 1 << (blocks - 1).bit_length()
        num_blocks = batch * blocks + 1
        cache = torch.randn(2, num_blocks, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
        perm = torch.randperm(num_blocks - 1).tolist()
        tables = [perm[i * blocks : (i + 1) * blocks] + [num_blocks - 1] * (width - blocks) for i in range(batch)]
        meta = build_attention_metadata([1] * batch, [context] * batch, tables, BS, device="cuda")
        meta.block_tables = meta.block_tables.long()
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn(2, batch, HKV, D, device="cuda", dtype=torch.bfloat16)
        backend = PaddedDecodeBackend()
        times = []
        for use_kernel in (False, True):
            paged_attention.triton_available.cache_clear()
            paged_attention.os.environ["GLIMPSE_PAGED_ATTENTION"] = "1" if use_kernel else "0"
            meta.derived.clear()
            times.append(cuda_ms(partial(backend.forward, q, k, v, cache, meta, D**-0.5), 50))
        live = 2 * batch * context * HKV * D * 2
        print(
            f"| {batch} | {context} | {width * BS} | {times[0]:.3f} | {times[1]:.3f} | {times[0] / times[1]:.1f}x "
            f"| {live / times[1] / 1e6:.0f} |"
        )
    paged_attention.triton_available.cache_clear()
    paged_attention.os.environ.pop("GLIMPSE_PAGED_ATTENTION", None)


if __name__ == "__main__":
    main()
