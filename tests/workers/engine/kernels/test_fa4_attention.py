"""FlashAttention-4 (pip ``flash-attn-4``): the adapters from its varlen call to the paged backend's and the ViT's
contracts (on the CPU, with FA4's call stood in for by the contract's torch reference), the opt-in choice and its
fallback, the engine's tokens through it, and the kernel itself where a Hopper or Blackwell GPU has the package."""

from __future__ import annotations

import logging
import os
import sys
import types
from itertools import accumulate
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.workers.engine.interpreted import run_interpreted
from tests.workers.engine.kernels.test_fa3_attention import (
    D,
    engine_matches_transformers,
    mixed_step,
    reference_kernel,
)
from workers.engine.kernels import backends, fa4_attention
from workers.engine.kernels.backends import get_attention_backend
from workers.engine.kernels.fa4_attention import FA4PagedBackend, packed_call, unavailable_reason
from workers.engine.kernels.torch_attention import FlashVarlenBackend, SdpaBackend
from workers.engine.layers.vision_attention import Segments, VisionAttention, _grouped_sdpa

GPU_REASON = "needs a Hopper or Blackwell GPU with flash-attn-4 installed"


def stand_in(calls: list[dict[str, Any]]) -> Any:
    """FA4's ``flash_attn_varlen_func`` as its signature and docstring say (keywords after q, k, v; an unbounded
    window side is None; (out, lse) back), computed by the contract's torch reference: paged with ``page_table``,
    packed segments with ``cu_seqlens_k``."""

    def fn(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Tensor, max_seqlen_q: int, max_seqlen_k: int,
           softmax_scale: float, causal: bool, seqused_k: Tensor | None = None, page_table: Tensor | None = None,
           cu_seqlens_k: Tensor | None = None, window_size: tuple[int | None, int | None] = (None, None),
           ) -> tuple[Tensor, None]:
        calls.append({"window_size": window_size, "paged": page_table is not None, "causal": causal})
        if page_table is not None:
            assert cu_seqlens_k is None and page_table.dtype == torch.int32 and seqused_k is not None
            left, right = (-1 if side is None else side for side in window_size)
            return reference_kernel(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=seqused_k,
                                    block_table=page_table, softmax_scale=softmax_scale, causal=causal,
                                    fa_version=3, window_size=(left, right)), None
        assert cu_seqlens_k is not None and window_size == (None, None)
        if causal:  # the LM's packed keys: each sequence's new tokens are the last of its keys (bottom-right)
            return packed_causal(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale), None
        assert torch.equal(cu_seqlens_k, cu_seqlens_q)
        bounds = cu_seqlens_q.tolist()
        return torch.cat([
            torch.nn.functional.scaled_dot_product_attention(
                *(t[s:e].transpose(0, 1) for t in (q, k, v)), scale=softmax_scale
            ).transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:], strict=True)
        ]), None  # fmt: skip

    return fn


def packed_causal(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float) -> Tensor:
    """Causal attention over packed sequences, query i of a sequence at key position (keys - queries) + i."""
    out = []
    for (qs, qe), (ks, ke) in zip(zip(cu_q.tolist()[:-1], cu_q.tolist()[1:]), zip(cu_k.tolist()[:-1], cu_k.tolist()[1:])):
        n, c = qe - qs, ke - ks
        group = q.shape[1] // k.shape[1]
        keys, values = (t[ks:ke].repeat_interleave(group, 1).transpose(0, 1).float() for t in (k, v))
        mask = torch.arange(c)[None, :] <= torch.arange(n)[:, None] + (c - n)
        attended = torch.nn.functional.scaled_dot_product_attention(q[qs:qe].transpose(0, 1).float(), keys, values,
                                                                    attn_mask=mask, scale=scale)
        out.append(attended.transpose(0, 1).to(q.dtype))
    return torch.cat(out)


@pytest.mark.parametrize("window", [0, 5])
def test_fa4_backend_hands_its_call_the_paged_cache_and_window(window: int) -> None:
    q, k, v, cache, meta = mixed_step("cpu", torch.bfloat16)
    expected_cache = cache.clone()
    expected = SdpaBackend().forward(q, k, v, expected_cache, meta, D**-0.5, window)
    calls: list[dict[str, Any]] = []
    backend = FA4PagedBackend(stand_in(calls), any_device=True)
    out = backend.forward(q, k, v, cache, meta, D**-0.5, window)
    assert torch.equal(cache, expected_cache)  # the new tokens' K and V written to the same slots
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    # FA4 writes an unbounded side as None (the fork: -1); causal bounds the right side itself.
    assert calls == [{"window_size": (window - 1, 0) if window else (None, None), "paged": True, "causal": True}]


def test_wide_heads_go_where_the_operator_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLIMPSE_FA4_WIDE_HEADS: heads wider than 128 read the blocks in place (pages, the default), FA4 over the keys
    packed end to end without a window (gather), or the FlashAttention-2 fallback (flash); the same answer and cache
    each way; narrower heads and windowed layers keep the pages."""
    q, k, v, cache, meta = mixed_step("cpu", torch.bfloat16)
    expected_cache = cache.clone()
    expected = SdpaBackend().forward(q, k, v, expected_cache, meta, D**-0.5)
    assert FA4PagedBackend(stand_in([]), any_device=True).wide_heads == "pages"
    seen = {}
    for mode in ("pages", "gather", "flash"):
        monkeypatch.setenv(fa4_attention.WIDE_HEADS, mode)
        calls: list[dict[str, Any]] = []
        backend = FA4PagedBackend(stand_in(calls), any_device=True)
        assert backend.supports(torch.zeros(1, 2, 256, dtype=torch.bfloat16)) == (mode != "flash")
        assert backend.supports(torch.zeros(1, 2, 128, dtype=torch.bfloat16))
        backend.wide_above = D - 1  # the step's heads count as wide
        step_cache = cache.clone()
        out = backend.forward(q, k, v, step_cache, meta, D**-0.5)
        assert torch.equal(step_cache, expected_cache)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
        backend.forward(q, k, v, step_cache, meta, D**-0.5, 5)
        seen[mode] = calls
    assert seen == {
        "pages": [{"window_size": (None, None), "paged": True, "causal": True},
                  {"window_size": (4, 0), "paged": True, "causal": True}],
        "gather": [{"window_size": (None, None), "paged": False, "causal": True},
                   {"window_size": (4, 0), "paged": True, "causal": True}],
        "flash": [],  # both steps on the fallback
    }  # fmt: skip
    monkeypatch.setenv(fa4_attention.WIDE_HEADS, "tma")
    with pytest.raises(ValueError, match="GLIMPSE_FA4_WIDE_HEADS='tma'"):
        FA4PagedBackend(stand_in([]), any_device=True)


GATHER_WITH_DECODES = """
import torch
from tests.workers.engine.kernels.test_fa4_attention import D, mixed_step, stand_in
from workers.engine.kernels.attention import decode_prefix
from workers.engine.kernels.fa4_attention import FA4PagedBackend
from workers.engine.kernels.torch_attention import SdpaBackend

q, k, v, cache, meta = mixed_step("cpu", torch.float16)
assert decode_prefix(meta) == 2
expected = SdpaBackend().forward(q, k, v, cache.clone(), meta, D**-0.5)
calls = []
backend = FA4PagedBackend(stand_in(calls), any_device=True)
backend.wide_heads, backend.wide_above = "gather", D - 1
out = backend.forward(q, k, v, cache, meta, D**-0.5)
torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
assert len(calls) == 1 and not calls[0]["paged"]  # the chunks on FA4; the decode rows on the Triton kernel
assert meta.derived["decode_prefix"] == 2
print("ok")
"""


def test_gathered_steps_send_their_decode_rows_to_the_paged_kernel() -> None:
    """In gather mode the step's leading decode rows read the cache in place through the Triton paged kernel (a decode
    row's whole context gathered for one query would cost more than its attention), the chunks after them go to FA4
    over their packed keys; together the SDPA reference's answer (CPU, Triton's interpreter)."""
    run_interpreted("-c", GATHER_WITH_DECODES)


def test_fa4_takes_windows_and_heads_to_256_and_leaves_512_to_the_fallback() -> None:
    """What FA4 passed on a GPU (heads of 128 and 256, with and without a window) runs on it; Gemma 4's 512-wide
    global heads, which FA4 asserts against, go to the fallback before the call, so no refusal turns every other
    layer off FA4."""
    calls: list[dict[str, Any]] = []
    backend = FA4PagedBackend(stand_in(calls), any_device=True)
    q, k, v, cache, meta = mixed_step("cpu", torch.bfloat16)
    expected = SdpaBackend().forward(q, k, v, cache.clone(), meta, D**-0.5, 5)
    out = backend.forward(q, k, v, cache, meta, D**-0.5, 5)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert calls == [{"window_size": (4, 0), "paged": True, "causal": True}]
    assert backend.supports(torch.zeros(1, 2, 256, dtype=torch.bfloat16))
    assert not backend.supports(torch.zeros(1, 2, 512, dtype=torch.bfloat16)) and not backend._refused


def test_an_error_of_fa4_s_dsl_falls_back_for_good_on_the_lm_and_the_vit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The CuTe DSL's errors (a compile or a driver it cannot use) derive from Exception only: once FA4 has imported
    the DSL they count as a refusal too, so a step falls back instead of failing the worker."""

    class DSLBaseError(Exception):
        pass

    dsl = types.ModuleType("cutlass.base_dsl.common")
    dsl.DSLBaseError = DSLBaseError  # type: ignore[attr-defined]

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise DSLBaseError("cannot compile for this driver")

    q, k, v, cache, meta = mixed_step("cpu", torch.bfloat16)
    backend = FA4PagedBackend(failing, any_device=True)
    with pytest.raises(DSLBaseError):  # not yet a refusal: nothing has imported the DSL
        backend.forward(q, k, v, cache.clone(), meta, D**-0.5)
    monkeypatch.setitem(sys.modules, "cutlass.base_dsl.common", dsl)
    expected_cache = cache.clone()
    expected = SdpaBackend().forward(q, k, v, expected_cache, meta, D**-0.5)
    with caplog.at_level(logging.WARNING):
        out = backend.forward(q, k, v, cache, meta, D**-0.5)
    assert torch.equal(out, expected) and torch.equal(cache, expected_cache)
    assert "FlashAttention-4 refused a step (DSLBaseError" in caplog.text
    layer = VisionAttention(64, 4)
    layer.packed = packed_call(failing)
    x = torch.randn(12, 4, 16, dtype=torch.bfloat16)
    seg = Segments(torch.tensor([0, 5, 12], dtype=torch.int32), [0, 5, 12], 7, frames=True)
    assert layer._on_packed(x, x, x, seg) is None and layer.packed is None


def test_the_vit_s_packed_call_reads_its_segments_on_both_sides() -> None:
    bounds = [0, 9, 20, 31]
    cu = torch.tensor(bounds, dtype=torch.int32)
    q, k, v = (torch.randn(31, 2, 16) for _ in range(3))
    calls: list[dict[str, Any]] = []
    out = packed_call(stand_in(calls))(q, k, v, cu, 11, 16**-0.5)
    seg = Segments(cu, bounds, 11, frames=True)
    torch.testing.assert_close(out, _grouped_sdpa(q, k, v, seg), rtol=1e-5, atol=1e-5)
    assert calls == [{"window_size": (None, None), "paged": False, "causal": False}]


def test_auto_picks_fa4_where_it_serves_and_without_it_serves_on_the_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        backend = get_attention_backend("fa4", "cpu")
    assert backend.name == "sdpa" and "FlashAttention-4 unavailable" in caplog.text
    assert unavailable_reason(torch.device("cpu"))
    monkeypatch.setattr(fa4_attention, "_load", lambda: (stand_in([]), ""))
    monkeypatch.setattr(fa4_attention, "unavailable_reason", lambda device: "")
    assert get_attention_backend("fa4", "cpu").name == "fa4"
    assert get_attention_backend("auto", "cpu").name == "fa4"  # measured ahead of FlashAttention-2 (session 39)
    assert get_attention_backend("sdpa", "cpu").name == "sdpa" and get_attention_backend("fa3", "cpu").name != "fa4"
    assert backends.vision_kernel("fa4", "cpu") is not None and backends.vision_kernel("auto", "cpu") is not None
    assert backends.vision_kernel("flash", "cpu") is None


def test_engine_on_the_fa4_backend_gives_transformers_tokens(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real runner's step inputs (prefix chunks, mixed steps, decode rows) through the FA4 adapter: greedy
    tokens equal transformers'. The contract's reference stands in for FA4's call, in float32."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(fa4_attention, "_load", lambda: (stand_in(calls), ""))
    monkeypatch.setattr(fa4_attention, "unavailable_reason", lambda device: "")
    monkeypatch.setattr(FA4PagedBackend, "supports", lambda self, q: True)
    engine = engine_matches_transformers(demo_model_dir, "fa4", 4)
    assert any(c["paged"] for c in calls)
    layers = [m for m in engine.runner.vision.modules() if isinstance(m, VisionAttention)]
    assert layers and all(m.packed is not None for m in layers)  # FA4's packed call, used on the CUDA path


def _gpu_ready() -> bool:
    return torch.cuda.is_available() and not unavailable_reason(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason=GPU_REASON)
@pytest.mark.parametrize("block", [16, 128])
def test_fa4_kernel_matches_flash_attention_2(block: int) -> None:
    """Decodes, a long chunk and a fresh prompt on the 7B's heads, in blocks of 16 (gathered pages) and of 128
    (`glimpse serve`'s CUDA default: whole key tiles, which FA4 loads by TMA)."""
    from tests.workers.engine.kernels.test_paged_attention import cuda_step

    torch.manual_seed(0)
    seq_lens = [int(n) for n in torch.randint(1, 3000, (6,))] + [2900, 300]
    q, k, v, cache, meta = cuda_step([1] * 6 + [700, 300], seq_lens, block, 3200 // block * 8)
    expected_cache = cache.clone()
    expected = FlashVarlenBackend().forward(q, k, v, expected_cache, meta, 128**-0.5)
    backend = get_attention_backend("fa4", "cuda")
    assert backend.name == "fa4"
    out = backend.forward(q, k, v, cache, meta, 128**-0.5)
    assert torch.equal(cache, expected_cache)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason=GPU_REASON)
@pytest.mark.parametrize("gather", [False, True])
def test_256_wide_heads_on_fa4_match_flash_attention_2(gather: bool) -> None:
    """Qwen3.5-9B's gated attention (16 query, 4 KV heads of 256) in 128-token blocks: on the pages in place (FA4's
    non-TMA path at these heads) and over the packed gather GLIMPSE_FA4_WIDE_HEADS=gather asks for."""
    from workers.engine.kernels.attention import build_attention_metadata

    torch.manual_seed(0)
    heads, kv_heads, d, block = 16, 4, 256, 128
    query_lens, seq_lens = [1] * 4 + [2100, 300], [900, 17, 3000, 129, 17000, 300]
    free = torch.randperm(400).tolist()
    tables = [[free.pop() for _ in range(-(-n // block))] for n in seq_lens]
    meta = build_attention_metadata(query_lens, seq_lens, tables, block, device="cuda")
    cache = torch.randn(2, 400, block, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(sum(query_lens), heads, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, sum(query_lens), kv_heads, d, device="cuda", dtype=torch.bfloat16)
    expected_cache = cache.clone()
    expected = FlashVarlenBackend().forward(q, k, v, expected_cache, meta, d**-0.5)
    backend = get_attention_backend("fa4", "cuda")
    assert isinstance(backend, FA4PagedBackend)
    backend.wide_heads = "gather" if gather else "pages"
    out = backend.forward(q, k, v, cache, meta, d**-0.5)
    assert torch.equal(cache, expected_cache) and not backend._refused
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason=GPU_REASON)
def test_vit_frames_on_fa4_match_the_default_kernels() -> None:
    torch.manual_seed(0)
    layer = VisionAttention(1280, 16).cuda().bfloat16()
    bounds = list(accumulate([1380, 2356], initial=0))
    seg = Segments(torch.tensor(bounds, dtype=torch.int32, device="cuda"), bounds, 2356, frames=True)
    x = torch.randn(bounds[-1], 1280, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(bounds[-1], 1280 // 32, device="cuda") * 6
    with torch.inference_mode():
        expected = layer(x, seg, angles.cos(), angles.sin(), flash=True)
        layer.packed = backends.vision_kernel("fa4", "cuda")
        out = layer(x, seg, angles.cos(), angles.sin(), flash=True)
    assert layer.packed is not None
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("preset", [False, True])
def test_fa4_keeps_its_compiled_kernels_on_disk_unless_the_operator_says_otherwise(
    preset: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The cache switch and folder are set before ``flash_attn.cute`` imports (it reads them then); an operator's own
    values stay."""
    seen: dict[str, str | None] = {}
    cute = types.ModuleType("flash_attn.cute")

    def __getattr__(name: str) -> Any:  # the import of flash_attn_varlen_func records the environment it saw
        seen.update({key: os.environ.get(key) for key in (fa4_attention.CACHE_FLAG, fa4_attention.CACHE_DIR)})
        return stand_in([])

    cute.__getattr__ = __getattr__  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in (fa4_attention.CACHE_FLAG, fa4_attention.CACHE_DIR):
        monkeypatch.setenv(key, "")  # recorded, so what _load sets is undone after the test
        monkeypatch.delenv(key)
    if preset:
        monkeypatch.setenv(fa4_attention.CACHE_FLAG, "0")
        monkeypatch.setenv(fa4_attention.CACHE_DIR, "/srv/kernels")
    fn, reason = fa4_attention._load.__wrapped__()
    assert fn is not None and reason == ""
    want = ("0", "/srv/kernels") if preset else ("1", str(tmp_path / ".cache/glimpse/flash-attn-cute"))
    assert (seen[fa4_attention.CACHE_FLAG], seen[fa4_attention.CACHE_DIR]) == want
