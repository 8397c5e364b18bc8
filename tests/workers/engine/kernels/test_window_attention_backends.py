"""Sliding windows, image spans and k = v = None on the CUDA backends (FlashAttention-2 varlen, the padded decode of
CUDA graphs, FA3). On the CPU their own work runs with a reference of each kernel's documented contract standing in
for the kernel; on a GPU (``gpu`` marker) the kernels themselves are compared with the SDPA backend."""

from __future__ import annotations

import random

import pytest
import torch

from tests.workers.engine.kernels.test_window_attention_masks import CASES
from tests.workers.engine.kernels.window_scenarios import Seq, Step, cpu_flash_backend, make_step, reference
from workers.engine.kernels import fa4_attention
from workers.engine.kernels.attention import build_attention_metadata
from workers.engine.kernels.backends import get_attention_backend
from workers.engine.kernels.fa3_attention import FA3PagedBackend, unavailable_reason
from workers.engine.kernels.fa4_attention import FA4PagedBackend
from workers.engine.kernels.kv_write_kernel import write_kv_cache
from workers.engine.kernels.paged_varlen import PagedVarlenBackend
from workers.engine.kernels.torch_attention import PaddedDecodeBackend, SdpaBackend

D = 16
SCALE = D**-0.5


@pytest.mark.parametrize("case", list(CASES))
def test_flash_backend_work_around_the_kernel_matches_transformers_masks(case: str) -> None:
    """Window arguments ((window - 1, 0): FlashAttention keeps [i - left, i]), the windowed packed gather (the
    kernel aligns rows to the last keys, so dropping keys in front keeps positions) and the span rows."""
    seqs, window, bidirectional = CASES[case]
    step = make_step(seqs, seed=11)
    out = cpu_flash_backend().forward(step.q, step.k, step.v, step.cache, step.meta, SCALE, window, bidirectional)
    torch.testing.assert_close(out, reference(step, SCALE, window, bidirectional), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 4])
def test_flash_backend_with_kv_none_reads_what_is_cached(window: int) -> None:
    """k = v = None on a step of fresh prompts: the keys come from the cache, not from the absent k."""
    step = make_step([Seq(0, 9, ((2, 7),)), Seq(0, 5), Seq(6, 4)], seed=12)
    write_kv_cache(step.k, step.v, step.cache, step.meta.slot_mapping)
    before = step.cache.clone()
    out = cpu_flash_backend().forward(step.q, None, None, step.cache, step.meta, SCALE, window, True)
    assert torch.equal(step.cache, before)
    torch.testing.assert_close(out, reference(step, SCALE, window, True), atol=1e-5, rtol=1e-5)


def test_flash_backend_caches_windowed_slots_per_window() -> None:
    step = make_step([Seq(12, 6), Seq(3, 4)], seed=13)
    backend = cpu_flash_backend()
    backend.forward(step.q, step.k, step.v, step.cache, step.meta, SCALE, 5, False)
    slots = step.meta.derived["flash_window_kv:5"]
    backend.forward(step.q, None, None, step.cache, step.meta, SCALE, 5, False)
    assert step.meta.derived["flash_window_kv:5"] is slots and "flash_packed_kv" not in step.meta.derived


def padded_decode_step(
    seq_lens: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]], int]:
    """A decode step's q, k, v, a cache whose last block (the tables' padding) is full of huge values, the tables
    and that block."""
    gen = torch.Generator().manual_seed(seed)
    blocks, block_size, hq, hkv = 64, 4, 6, 2
    scratch = blocks - 1
    cache = torch.randn(2, blocks, block_size, hkv, D, generator=gen)
    cache[:, scratch] = 1e4
    free = list(range(scratch))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    q = torch.randn(len(seq_lens), hq, D, generator=gen)
    k, v = torch.randn(2, len(seq_lens), hkv, D, generator=gen)
    return q, k, v, cache, tables, scratch


@pytest.mark.parametrize("window", [1, 3, 6, 64])
@pytest.mark.parametrize("kv_none", [False, True])
def test_padded_decode_window_matches_sdpa(window: int, kv_none: bool) -> None:
    """The graphs' decode (SDPA with a length mask here) hides the keys before the window too."""
    seq_lens, width = [1, 5, 8, 13, 4], 5
    q, k, v, cache, tables, scratch = padded_decode_step(seq_lens, seed=window)
    meta, padded = (
        build_attention_metadata([1] * len(seq_lens), seq_lens, t, 4)
        for t in (tables, [t + [scratch] * (width - len(t)) for t in tables])
    )
    padded.block_tables = padded.block_tables.long()
    ref_cache, cache_out = cache.clone(), cache.clone()
    expected = SdpaBackend().forward(q, k, v, ref_cache, meta, SCALE, window)
    if kv_none:
        write_kv_cache(k, v, cache_out, padded.slot_mapping)
        out = PaddedDecodeBackend().forward(q, None, None, cache_out, padded, SCALE, window, True)
    else:
        out = PaddedDecodeBackend().forward(q, k, v, cache_out, padded, SCALE, window, True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache_out, ref_cache)
    if window < max(seq_lens):  # the window cut some sequence's keys, so this compared something
        assert not torch.allclose(out, SdpaBackend().forward(q, None, None, ref_cache, meta, SCALE), atol=1e-3)


@pytest.mark.parametrize("case", [c for c in CASES if "span" in c or "window" in c])
def test_fa3_backend_passes_the_window_and_recomputes_span_rows(case: str) -> None:
    """FA3 on the kernel contract's reference (bf16, as FA3 takes it): window (window - 1, 0), then the span rows."""
    from tests.workers.engine.kernels.test_fa3_attention import reference_kernel

    seqs, window, bidirectional = CASES[case]
    step = make_step(seqs, seed=14, dtype=torch.bfloat16)
    out = FA3PagedBackend(kernel=reference_kernel, any_device=True).forward(
        step.q, step.k, step.v, step.cache, step.meta, SCALE, window, bidirectional
    )
    torch.testing.assert_close(out.float(), reference(step, SCALE, window, bidirectional), atol=2e-2, rtol=2e-2)


def test_fa3_backend_with_kv_none_writes_nothing() -> None:
    from tests.workers.engine.kernels.test_fa3_attention import reference_kernel

    step = make_step([Seq(8, 8, ((5, 12),)), Seq(0, 6)], seed=15, dtype=torch.bfloat16)
    write_kv_cache(step.k, step.v, step.cache, step.meta.slot_mapping)
    before = step.cache.clone()
    out = FA3PagedBackend(kernel=reference_kernel, any_device=True).forward(
        step.q, None, None, step.cache, step.meta, SCALE, 3, True
    )
    assert torch.equal(step.cache, before)
    torch.testing.assert_close(out.float(), reference(step, SCALE, 3, True), atol=2e-2, rtol=2e-2)


# A sliding layer's mixed step on a GPU: long decodes (past the window), a chunk after a long prefix holding a partly
# cached image, a fresh prompt with two images, a short chunk; blocks of 16, heads of 128, GQA 4.
GPU_STEP = [Seq(900, 1), Seq(40, 1), Seq(1500, 1), Seq(700, 300, ((650, 760), (900, 990))),
            Seq(0, 400, ((10, 150), (200, 390))), Seq(70, 20)]
GPU_WINDOW = 128
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def gpu_step(seed: int, d: int = 128, window: int = GPU_WINDOW) -> tuple[Step, torch.Tensor]:
    """The GPU step in bf16 with heads of ``d`` and what the SDPA backend gives in float32 on the same data with
    ``window`` (cache already written)."""
    step = make_step(GPU_STEP, hq=16, hkv=4, d=d, block_size=16, seed=seed, dtype=torch.bfloat16, device="cuda")
    ref_cache = step.cache.float()
    expected = SdpaBackend().forward(
        step.q.float(), step.k.float(), step.v.float(), ref_cache, step.meta, d**-0.5, window, True
    )
    step.meta.derived.clear()
    return step, expected


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kv_none", [False, True])
def test_flash_backend_on_cuda_window_and_spans_match_sdpa(kv_none: bool) -> None:
    """Decode rows on the Triton kernel with its window, chunks on FlashAttention-2 with (window - 1, 0) over the
    windowed gather, the image rows recomputed; and k = v = None reading what was written."""
    step, expected = gpu_step(21)
    backend = get_attention_backend("flash", "cuda")
    assert backend.name == "flash"
    if kv_none:
        write_kv_cache(step.k, step.v, step.cache, step.meta.slot_mapping)
        before = step.cache.clone()
        out = backend.forward(step.q, None, None, step.cache, step.meta, 128**-0.5, GPU_WINDOW, True)
        assert torch.equal(step.cache, before)
    else:
        out = backend.forward(step.q, step.k, step.v, step.cache, step.meta, 128**-0.5, GPU_WINDOW, True)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("path", ["triton", "flash", "sdpa"])
def test_padded_decode_on_cuda_window_matches_sdpa(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphs' decode with a window on each of its paths, under a captured graph with a split-length input."""
    from workers.engine.kernels import paged_attention, torch_attention

    if path != "triton":
        monkeypatch.setattr(paged_attention, "usable", lambda q: False)
    if path == "sdpa":
        monkeypatch.setattr(torch_attention, "_flash_seqused_available", lambda: False)
    elif not paged_attention.usable(torch.zeros(1, 1, 128, device="cuda", dtype=torch.bfloat16)) and path == "triton":
        pytest.skip("no Triton paged kernel here")
    seqs = [Seq(n - 1, 1) for n in (1, 90, 700, 2000, 129)]
    step = make_step(seqs, hq=16, hkv=4, d=128, block_size=16, seed=22, dtype=torch.bfloat16, device="cuda")
    expected = SdpaBackend().forward(
        step.q.float(), step.k.float(), step.v.float(), step.cache.float(), step.meta, 128**-0.5, GPU_WINDOW
    )
    width = 128  # blocks: 2,048 keys, padded with block 0
    padded = build_attention_metadata(
        [1] * len(seqs), [s.context + 1 for s in seqs],
        [[0] * width for _ in seqs], 16, device="cuda",
    )
    padded.block_tables[:, : step.meta.block_tables.shape[1]] = step.meta.block_tables
    padded.block_tables = padded.block_tables.long()
    padded.slot_mapping = step.meta.slot_mapping
    padded.derived["split_tokens"] = torch.tensor([64], dtype=torch.int64, device="cuda")
    backend = PaddedDecodeBackend()
    backend.forward(step.q, step.k, step.v, step.cache, padded, 128**-0.5, GPU_WINDOW)  # warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(step.q, step.k, step.v, step.cache, padded, 128**-0.5, GPU_WINDOW)
    graph.replay()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def _serves(name: str) -> bool:
    if not torch.cuda.is_available():
        return False
    reason = (unavailable_reason if name == "fa3" else fa4_attention.unavailable_reason)(torch.device("cuda"))
    return not reason


@pytest.mark.gpu
@pytest.mark.parametrize("name", [  # a build of vLLM's fork; pip flash-attn-4 (auto's choice)
    pytest.param(name, marks=pytest.mark.skipif(not _serves(name), reason=f"needs a CUDA device where {name} serves"))
    for name in ("fa3", "fa4")
])  # fmt: skip
@pytest.mark.parametrize("kv_none", [False, True])
def test_flash_attention_on_cuda_window_and_spans_match_sdpa(name: str, kv_none: bool) -> None:
    step, expected = gpu_step(23)
    backend = get_attention_backend(name, "cuda")
    assert backend.name == name and isinstance(backend, PagedVarlenBackend)
    if kv_none:
        write_kv_cache(step.k, step.v, step.cache, step.meta.slot_mapping)
    k, v = (None, None) if kv_none else (step.k, step.v)
    out = backend.forward(step.q, k, v, step.cache, step.meta, 128**-0.5, GPU_WINDOW, True)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _serves("fa4"), reason="needs a CUDA device where fa4 serves")
@pytest.mark.parametrize("d", [128, 256, 512])  # Qwen's heads; Gemma 4's sliding and global heads
@pytest.mark.parametrize("window", [0, GPU_WINDOW])
def test_fa4_runs_the_heads_and_windows_it_claims(d: int, window: int) -> None:
    """FA4PagedBackend.max_head_dim and .windows say which layers FA4 takes: those run on the kernel without a
    refusal (one would move every later layer to the fallback) and match SDPA; the rest go to the fallback unseen
    by the kernel and match too."""
    step, expected = gpu_step(24, d, window)
    backend = FA4PagedBackend()
    kernel, calls = backend._kernel, []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return kernel(*args, **kwargs)

    backend._kernel = counted
    out = backend.forward(step.q, step.k, step.v, step.cache, step.meta, d**-0.5, window, True)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert not backend._refused
    assert bool(calls) == (d <= backend.max_head_dim and (window == 0 or backend.windows))
