"""Paged attention backends against a naive explicit-softmax reference."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from workers.engine.kernels.attention import AttentionBackend, AttentionMetadata, build_attention_metadata
from workers.engine.kernels.backends import get_attention_backend
from workers.engine.kernels.torch_attention import (
    FlashVarlenBackend,
    PaddedDecodeBackend,
    SdpaBackend,
    flash_available,
)

HQ, HKV, D = 6, 2, 16
BLOCK_SIZE = 4
NUM_BLOCKS = 64
# (cached context length, new tokens): fresh prefill, decodes, chunks continuing a cached prefix.
SEQUENCES = [(0, 7), (5, 1), (9, 4), (3, 3), (0, 1), (12, 9), (16, 1)]


def naive_attention(q: Tensor, k: Tensor, v: Tensor, context: int, scale: float) -> Tensor:
    """q [n, Hq, D]; k/v [context + n, Hkv, D] -> [n, Hq, D] with explicit masking and softmax in float64."""
    n = q.shape[0]
    k = k.double().repeat_interleave(HQ // HKV, dim=1)
    v = v.double().repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.arange(k.shape[0])[None, :] <= (context + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)


@dataclass
class Scenario:
    cache: Tensor
    meta: AttentionMetadata
    q: Tensor
    k: Tensor
    v: Tensor
    full_k: list[Tensor]  # every sequence's whole K (context + new), float32 on CPU
    full_v: list[Tensor]

    def run(self, backend: AttentionBackend, scale: float, cache: Tensor | None = None) -> Tensor:
        return backend.forward(
            self.q, self.k, self.v, self.cache if cache is None else cache, self.meta, scale
        )


def scenario(seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Scenario:
    """Random cache with each sequence's context already written, plus new q/k/v and metadata."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(1, NUM_BLOCKS))  # block 0 doubles as table padding; keep it unused to catch misuse
    random.Random(seed).shuffle(free)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HKV, D, generator=gen)
    tables, full_k, full_v = [], [], []
    for context, new in SEQUENCES:
        n_blocks = -(-(context + new) // BLOCK_SIZE)
        table = [free.pop() for _ in range(n_blocks)]
        tables.append(table)
        k = torch.randn(context + new, HKV, D, generator=gen)
        v = torch.randn(context + new, HKV, D, generator=gen)
        for pos in range(context):  # the cached prefix lives in the cache already
            cache[0, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k[pos]
            cache[1, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v[pos]
        full_k.append(k)
        full_v.append(v)
    meta = build_attention_metadata(
        [n for _, n in SEQUENCES], [c + n for c, n in SEQUENCES], tables, BLOCK_SIZE, device=device
    )
    q = torch.randn(sum(n for _, n in SEQUENCES), HQ, D, generator=gen)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, SEQUENCES, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, SEQUENCES, strict=True)])
    return Scenario(
        cache.to(device, dtype),
        meta,
        q.to(device, dtype),
        new_k.to(device, dtype),
        new_v.to(device, dtype),
        full_k,
        full_v,
    )


def reference(s: Scenario, scale: float) -> Tensor:
    """float32 CPU reference for every new token of the scenario."""
    outs, start = [], 0
    for (context, new), k, v in zip(SEQUENCES, s.full_k, s.full_v, strict=True):
        outs.append(naive_attention(s.q[start : start + new].float().cpu(), k, v, context, scale))
        start += new
    return torch.cat(outs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sdpa_backend_matches_naive_reference_and_writes_cache(seed: int) -> None:
    s = scenario(seed)
    before = s.cache.clone()
    scale = D**-0.5 * 1.3  # a non-default scale must be honoured
    out = s.run(SdpaBackend(), scale)
    torch.testing.assert_close(out, reference(s, scale), atol=1e-5, rtol=1e-5)

    slots = s.meta.slot_mapping
    flat = s.cache.view(2, -1, HKV, D)
    assert torch.equal(flat[0, slots], s.k) and torch.equal(flat[1, slots], s.v)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], before.view(2, -1, HKV, D)[:, untouched])


def test_metadata_layout() -> None:
    meta = build_attention_metadata([3, 1], [3, 6], [[7], [2, 5]], block_size=4)
    assert meta.query_start_loc.tolist() == [0, 3, 4] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [3, 6] and meta.seq_lens.dtype == torch.int32
    assert meta.slot_mapping.tolist() == [28, 29, 30, 5 * 4 + 1] and meta.slot_mapping.dtype == torch.int64
    assert meta.block_tables.tolist() == [[7, 0], [2, 5]] and meta.block_tables.dtype == torch.int32
    assert (meta.max_query_len, meta.max_seq_len) == (3, 6)


def test_flash_packed_gather_matches_per_sequence_kv() -> None:
    """The flash path's batched block-table gather is plain torch indexing, so it is checked on CPU."""
    s = scenario(4)
    s.run(SdpaBackend(), 1.0)  # writes the new tokens' K/V
    k_all, v_all, cu = FlashVarlenBackend.gather_packed_kv(s.cache, s.meta)
    assert cu.dtype == torch.int32 and cu.tolist() == [
        0,
        *torch.tensor(s.meta.seq_lens_cpu).cumsum(0).tolist(),
    ]
    assert torch.equal(k_all, torch.cat(s.full_k)) and torch.equal(v_all, torch.cat(s.full_v))


def test_packed_gather_is_computed_once_per_forward() -> None:
    s = scenario(7)
    s.run(SdpaBackend(), 1.0)
    first = FlashVarlenBackend.gather_packed_kv(s.cache, s.meta)
    again = FlashVarlenBackend.gather_packed_kv(s.cache, s.meta)  # the next layer: same derived slots
    assert s.meta.derived["flash_packed_kv"][1] is first[2] is again[2]


DECODE_CASES = [(0, "cpu", torch.float32), (1, "cpu", torch.float32)]
if torch.cuda.is_available():  # the FlashAttention split-KV path (bf16/fp16 on CUDA)
    DECODE_CASES += [(2, "cuda", torch.bfloat16), (3, "cuda", torch.float16), (4, "cuda", torch.float32)]


@pytest.mark.parametrize(("seed", "device", "dtype"), DECODE_CASES)
def test_padded_decode_backend_matches_sdpa_with_garbage_padding(
    seed: int, device: str, dtype: torch.dtype
) -> None:
    """Fixed-shape decode (CUDA-graph path): tables padded past each sequence with a block full of
    huge values must give what the reference gives, and write the same cache slots."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens, width, scratch = [1, 5, 8, 13, 4], 5, NUM_BLOCKS - 1
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HKV, D, generator=gen)
    cache[:, scratch] = 1e4  # padding reads this block; the lengths must hide it
    free = list(range(scratch))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in seq_lens]
    q = torch.randn(len(seq_lens), HQ, D, generator=gen)
    k, v = torch.randn(2, len(seq_lens), HKV, D, generator=gen)
    q, k, v, cache = (t.to(device, dtype) for t in (q, k, v, cache))
    meta, padded = (
        build_attention_metadata([1] * len(seq_lens), seq_lens, t, BLOCK_SIZE, device=device)
        for t in (tables, [t + [scratch] * (width - len(t)) for t in tables])
    )
    padded.block_tables = padded.block_tables.long()  # as the CUDA graphs hold it
    ref_cache, cache_out = cache.clone(), cache.clone()
    expected = SdpaBackend().forward(q, k, v, ref_cache, meta, D**-0.5)
    out = PaddedDecodeBackend().forward(q, k, v, cache_out, padded, D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    assert torch.equal(cache_out, ref_cache)


def test_registry_falls_back_to_sdpa_off_cuda() -> None:
    assert get_attention_backend("auto", "cpu").name == "sdpa"
    assert get_attention_backend("flash", torch.device("cpu")).name == "sdpa"
    assert get_attention_backend("sdpa", "cpu").name == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("nope", "cpu")


def test_flash_backend_hands_unsupported_inputs_to_sdpa() -> None:
    if not flash_available():
        pytest.skip("this torch has no varlen flash attention")
    s = scenario(5)  # float32 on CPU: not the kernel's inputs, so it must fall back, not fail
    torch.testing.assert_close(
        s.run(FlashVarlenBackend(), D**-0.5), reference(s, D**-0.5), atol=1e-5, rtol=1e-5
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_backend_on_cuda_matches_reference(dtype: torch.dtype) -> None:
    backend = get_attention_backend("flash", "cuda")
    assert backend.name == "flash"
    s = scenario(6, dtype=dtype, device="cuda")
    sdpa_cache = s.cache.clone()
    out = s.run(backend, D**-0.5)
    torch.testing.assert_close(out.float().cpu(), reference(s, D**-0.5), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, s.run(SdpaBackend(), D**-0.5, cache=sdpa_cache), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(s.cache, sdpa_cache, atol=0, rtol=0)  # both wrote the same slots

