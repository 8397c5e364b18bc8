"""The optional FlashAttention-3 backend (fa3_attention.py): what it hands the kernel, checked on the CPU against
a plain-torch reference of the kernel's documented contract, and on a GPU with the kernel installed against
torch's FlashAttention-2 path."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.workers.engine.test_engine import GREEDY, Reference, chat, make_engine, noise_image
from workers.engine import fa3_attention
from workers.engine.attention import (
    AttentionMetadata,
    FlashVarlenBackend,
    SdpaBackend,
    build_attention_metadata,
    get_attention_backend,
)
from workers.engine.fa3_attention import FA3PagedBackend, unavailable_reason

BLOCK = 4
HQ, HKV, D = 6, 2, 16
# A mixed step as the scheduler builds it: two decode rows first, then a prompt chunk after its cached prefix,
# then a fresh prompt; each sequence's blocks scattered over the cache.
QUERY_LENS = [1, 1, 9, 12]
SEQ_LENS = [37, 6, 30, 12]


def reference_kernel(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, max_seqlen_q: int, cu_seqlens_q: Tensor, max_seqlen_k: int, *,
    seqused_k: Tensor, block_table: Tensor, softmax_scale: float, causal: bool, fa_version: int,
) -> Tensor:
    """``flash_attn_varlen_func``'s documented contract for a paged cache, in float32 torch: sequence b's keys are
    the first ``seqused_k[b]`` slots of its blocks, query head h reads KV head ``h // (Hq / Hkv)``, and the causal
    mask is aligned bottom-right."""
    assert fa_version == 3 and causal
    assert cu_seqlens_q.dtype == seqused_k.dtype == block_table.dtype == torch.int32
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        used, new = int(seqused_k[b]), end - start
        assert new <= max_seqlen_q and used <= max_seqlen_k
        pos = torch.arange(used)
        slots = block_table[b, pos // block_size].long() * block_size + pos % block_size
        keys, values = (c.flatten(0, 1)[slots].float().repeat_interleave(group, 1) for c in (k_cache, v_cache))
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * softmax_scale
        scores = scores.masked_fill(pos[None] > torch.arange(new)[:, None] + (used - new), float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


def mixed_step(device: str, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, AttentionMetadata]:
    gen = torch.Generator().manual_seed(7)
    need = [-(-s // BLOCK) for s in SEQ_LENS]
    order = torch.randperm(sum(need) + 5, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    meta = build_attention_metadata(QUERY_LENS, SEQ_LENS, tables, BLOCK, device)
    cache = torch.randn(2, sum(need) + 5, BLOCK, HKV, D, generator=gen).to(device, dtype)  # the prefixes' KV
    t = sum(QUERY_LENS)
    q, k, v = (torch.randn(t, h, D, generator=gen).to(device, dtype) for h in (HQ, HKV, HKV))
    return q, k, v, cache, meta


def test_fa3_backend_hands_the_kernel_the_paged_cache_lengths_and_tables() -> None:
    q, k, v, cache, meta = mixed_step("cpu", torch.bfloat16)
    expected_cache = cache.clone()
    expected = SdpaBackend().forward(q, k, v, expected_cache, meta, D**-0.5)
    backend = FA3PagedBackend(kernel=reference_kernel, any_device=True)
    out = backend.forward(q, k, v, cache, meta, D**-0.5)
    assert torch.equal(cache, expected_cache)  # the new tokens' K and V written to the same slots
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    # The reference itself tells a wrong block table apart (so the comparison above can fail).
    shuffled = AttentionMetadata(**{**meta.__dict__, "block_tables": meta.block_tables.flip(1), "derived": {}})
    assert not torch.allclose(backend.forward(q, k, v, cache, shuffled, D**-0.5).float(), expected.float(), atol=0.1)


def test_fa3_backend_sends_float32_to_its_fallback() -> None:
    q, k, v, cache, meta = mixed_step("cpu", torch.float32)

    def never(*args: object, **kwargs: object) -> Tensor:
        raise AssertionError("float32 must not reach the FA3 kernel")

    expected_cache = cache.clone()
    expected = SdpaBackend().forward(q, k, v, expected_cache, meta, D**-0.5)
    out = FA3PagedBackend(kernel=never, any_device=True).forward(q, k, v, cache, meta, D**-0.5)
    assert torch.equal(out, expected) and torch.equal(cache, expected_cache)


def test_fa3_without_a_kernel_serves_on_the_default_backend(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        backend = get_attention_backend("fa3", "cpu")
    assert backend.name == "sdpa"
    assert "FlashAttention-3 unavailable" in caplog.text
    assert unavailable_reason(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or bool(unavailable_reason(torch.device("cuda"))),
    reason="needs a CUDA device with an FA3 build of vLLM's flash-attention installed",
)
def test_fa3_kernel_matches_flash_attention_2_on_a_mixed_step() -> None:
    q, k, v, cache, meta = mixed_step("cuda", torch.bfloat16)
    expected_cache = cache.clone()
    expected = FlashVarlenBackend().forward(q, k, v, expected_cache, meta, D**-0.5)
    backend = get_attention_backend("fa3", "cuda")
    assert backend.name == "fa3"
    out = backend.forward(q, k, v, cache, meta, D**-0.5)
    assert torch.equal(cache, expected_cache)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_engine_on_the_fa3_backend_gives_transformers_tokens(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real runner's step inputs (prefix chunks, mixed steps, decode rows) through the backend and the kernel
    contract: greedy tokens equal transformers'. The contract's reference stands in for the kernel, in float32."""
    calls = []

    def kernel(*args: Any, **kwargs: Any) -> Tensor:
        calls.append(len(kwargs["seqused_k"]))
        return reference_kernel(*args, **kwargs)

    monkeypatch.setattr(fa3_attention, "_load", lambda: (kernel, ""))
    monkeypatch.setattr(fa3_attention, "unavailable_reason", lambda device: "")
    monkeypatch.setattr(FA3PagedBackend, "supports", lambda self, q: True)
    requests = [chat("Short one." * (1 + i), [noise_image(60 + 30 * i, 90 - 5 * i, seed=100 + i)] * (i % 3))
                for i in range(5)]
    outs = make_engine(demo_model_dir, chunk_size=32, attn_backend="fa3").generate(requests, GREEDY)
    reference = Reference(demo_model_dir)
    for messages, out in zip(requests, outs, strict=True):
        assert out.token_ids == reference.generate(messages)
    assert max(calls) > 1  # steps with several sequences went through the kernel


def test_the_fork_inside_an_installed_vllm_loads_without_importing_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's package import has side effects (environment, torch settings), so the FA3 build it bundles is loaded
    as a package of its own, and so is one in the folder named by GLIMPSE_FA3_PATH."""
    fork = tmp_path / "site" / "vllm" / "vllm_flash_attn"
    fork.mkdir(parents=True)
    (fork.parent / "__init__.py").write_text("raise RuntimeError('vllm itself was imported')\n")
    (fork / "__init__.py").write_text("from .flash_attn_interface import flash_attn_varlen_func\n")
    (fork / "flash_attn_interface.py").write_text(
        "def flash_attn_varlen_func(*args, **kwargs):\n    return 'fa3 from the fork'\n\n"
        "def is_fa_version_supported(version):\n    return version == 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for env in ({}, {"GLIMPSE_FA3_PATH": str(fork.parent)}):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        for name in [m for m in sys.modules if m.startswith("vllm_flash_attn")]:
            monkeypatch.delitem(sys.modules, name)
        fa3_attention._load.cache_clear()
        try:
            kernel, reason = fa3_attention._load()
        finally:
            fa3_attention._load.cache_clear()
        assert reason == "" and kernel is not None and kernel() == "fa3 from the fork"
        assert "vllm" not in sys.modules
    for name in [m for m in sys.modules if m.startswith("vllm_flash_attn")]:
        del sys.modules[name]
