"""The Triton paged decode kernel (CUDA decode path) checked on the CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.workers.engine.interpreted import run_interpreted
from workers.engine.kernels import paged_attention
from workers.engine.kernels.attention import (
    AttentionMetadata,
    build_attention_metadata,
    decode_prefix,
    tail_metadata,
)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="with a GPU the CUDA tests below run the kernel itself (and its Triton may differ)"
)
def test_kernel_matches_reference_in_triton_interpreter() -> None:
    run_interpreted("-m", "tests.workers.engine.kernels.paged_attention_check")


def test_kernel_is_not_taken_for_cpu_tensors_without_the_interpreter() -> None:
    assert not paged_attention.interpreted()
    assert not paged_attention.usable(torch.zeros(2, 4, 16))


@pytest.mark.parametrize(
    ("batch", "tokens", "heads", "expected"),
    [
        (64, 4096, 4, (2, 2048)), (1, 300, 4, (5, 64)), (1, 10, 1, (1, 64)), (200, 64, 8, (1, 64)),
        # Few programs walking long splits: cut to 32 tiles each. A grid of ~4 programs per SM stays as it is.
        (8, 32768, 4, (16, 2048)), (32, 32768, 4, (16, 2048)), (128, 4096, 4, (1, 4096)),
    ],
)
def test_split_plan_fills_the_gpu_and_covers_every_key(
    batch: int, tokens: int, heads: int, expected: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(paged_attention, "_sm_count", lambda index: 132)
    splits, per_split = paged_attention.plan_splits(batch, tokens, heads, torch.device("cuda", 0))
    assert (splits, per_split) == expected
    assert per_split % paged_attention.TILE == 0
    assert splits * per_split >= tokens > (splits - 1) * per_split


def test_mixed_step_splits_leading_decodes_from_prefill_chunks() -> None:
    # Two decodes first (as the scheduler orders a step), then a chunk continuing a prefix and a fresh prompt.
    meta = build_attention_metadata([1, 1, 4, 3], [9, 5, 10, 3], [[1, 2, 3], [4, 5], [6, 7, 8], [9]], 4)
    assert decode_prefix(meta) == 2
    tail: AttentionMetadata = tail_metadata(meta, 2)
    assert tail.query_start_loc.tolist() == [0, 4, 7]
    assert tail.seq_lens.tolist() == [10, 3] and tail.query_lens_cpu == [4, 3]
    assert tail.block_tables.tolist() == [[6, 7, 8], [9, 0, 0]]
    assert tail.slot_mapping.tolist() == meta.slot_mapping[2:].tolist()
    assert (tail.max_query_len, tail.max_seq_len) == (4, 10)
    assert decode_prefix(build_attention_metadata([3, 1], [3, 4], [[1], [2]], 4)) == 0


HQ, HKV, D = 28, 4, 128  # Qwen2.5-VL-7B's LM


def cuda_step(
    query_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, AttentionMetadata]:
    """q, k, v of one LM step on the 7B's heads (bf16, CUDA), a random paged cache and the step's metadata, every
    sequence's blocks drawn at random from the cache."""
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, device="cuda")
    cache = torch.randn(2, num_blocks, block_size, HKV, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(sum(query_lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, sum(query_lens), HKV, D, device="cuda", dtype=torch.bfloat16)
    return q, k, v, cache, meta


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_step_on_cuda_matches_sdpa() -> None:
    """FlashVarlenBackend with decodes first: the decode rows take the kernel, the chunks the packed path."""
    from workers.engine.kernels.torch_attention import FlashVarlenBackend, SdpaBackend

    torch.manual_seed(0)
    d = D
    query_lens = [1] * 40 + [700, 1]  # a trailing single-token chunk is not in the decode prefix
    seq_lens = [int(n) for n in torch.randint(1, 3000, (40,))] + [2900, 1200]
    q, k, v, cache, meta = cuda_step(query_lens, seq_lens, 16, 4000)
    ref_cache = cache.clone()
    expected = SdpaBackend().forward(q.float(), k.float(), v.float(), ref_cache.float(), meta, d**-0.5)
    out = FlashVarlenBackend().forward(q, k, v, cache, meta, d**-0.5)
    assert meta.derived["decode_prefix"] == 40
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
