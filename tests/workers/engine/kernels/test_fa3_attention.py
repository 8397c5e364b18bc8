"""The optional FlashAttention-3 backend (fa3_attention.py): what it hands the kernel, checked on the CPU against
a plain-torch reference of the kernel's documented contract, and on a GPU with the kernel installed against
torch's FlashAttention-2 path."""

from __future__ import annotations

import logging
import sys
from itertools import accumulate
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.workers.engine.test_offline import GREEDY, Reference, chat, make_engine, noise_image
from workers.engine.kernels import fa3_attention
from workers.engine.kernels.attention import AttentionMetadata, build_attention_metadata
from workers.engine.kernels.backends import get_attention_backend
from workers.engine.kernels.fa3_attention import FA3PagedBackend, unavailable_reason
from workers.engine.kernels.torch_attention import FlashVarlenBackend, SdpaBackend
from workers.engine.layers.vision_attention import Segments, VisionAttention, _grouped_sdpa

BLOCK = 4
HQ, HKV, D = 6, 2, 16
# A mixed step as the scheduler builds it: two decode rows first, then a prompt chunk after its cached prefix,
# then a fresh prompt; each sequence's blocks scattered over the cache.
QUERY_LENS = [1, 1, 9, 12]
SEQ_LENS = [37, 6, 30, 12]


def reference_kernel(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, max_seqlen_q: int, cu_seqlens_q: Tensor, max_seqlen_k: int, *,
    seqused_k: Tensor, block_table: Tensor, softmax_scale: float, causal: bool, fa_version: int,
    window_size: tuple[int, int] = (-1, -1),
) -> Tensor:
    """``flash_attn_varlen_func``'s documented contract for a paged cache, in float32 torch: sequence b's keys are
    the first ``seqused_k[b]`` slots of its blocks, query head h reads KV head ``h // (Hq / Hkv)``, and the causal
    mask is aligned bottom-right; ``window_size`` (left, right) keeps keys [i - left, i + right] of the aligned
    position i (-1: unbounded; causal makes right 0)."""
    assert fa_version == 3 and causal and window_size[1] in (-1, 0)
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
        aligned = torch.arange(new)[:, None] + (used - new)
        hidden = pos[None] > aligned
        if window_size[0] >= 0:
            hidden |= pos[None] < aligned - window_size[0]
        scores = scores.masked_fill(hidden, float("-inf"))
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


def test_a_step_the_build_refuses_falls_back_for_good(caplog: pytest.LogCaptureFixture) -> None:
    """A build's argument checks raise (a head size it was not built for): that step and every later one run on the
    default backend, with one warning, instead of failing the requests."""
    calls = []

    def refusing(*args: Any, **kwargs: Any) -> Tensor:
        calls.append(1)
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256\nmore")

    backend = FA3PagedBackend(kernel=refusing, any_device=True)
    q, k, v, cache, meta = mixed_step("cpu", torch.bfloat16)
    expected_cache = cache.clone()
    expected = SdpaBackend().forward(q, k, v, expected_cache, meta, D**-0.5)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            out = backend.forward(q, k, v, cache, meta, D**-0.5)
            assert torch.equal(out, expected) and torch.equal(cache, expected_cache)
    assert len(calls) == 1 and caplog.text.count("FlashAttention-3 refused a step") == 1


def test_a_vit_frame_call_the_build_refuses_leaves_the_layer_on_its_default_kernels() -> None:
    layer = VisionAttention(64, 4)
    layer.packed = lambda *args: (_ for _ in ()).throw(RuntimeError("head dimension not supported"))
    q = torch.randn(12, 4, 16)
    seg = Segments(torch.tensor([0, 12], dtype=torch.int32), [0, 12], 12, frames=True)
    assert layer._on_packed(q, q, q, seg) is None and layer.packed is None


def test_a_head_size_the_build_refuses_is_tried_again_zero_padded() -> None:
    """Qwen3-VL's ViT heads of 72: a build that takes only multiples of 16 gets them padded to 80, and the layer's
    output is the unpadded attention's; a build that refuses the padded call too leaves the default kernels."""
    layer = VisionAttention(144, 2)  # 2 heads of 72
    bounds = [0, 9, 20]
    seg = Segments(torch.tensor(bounds, dtype=torch.int32), bounds, 11, frames=True)
    q, k, v = (torch.randn(20, 2, 72) for _ in range(3))
    dims = []

    def only_multiples_of_16(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, top: int, scale: float) -> Tensor:
        dims.append(q.shape[-1])
        if q.shape[-1] % 16:
            raise RuntimeError("This flash attention build does not support headdim not being a multiple of 16")
        assert scale == 72**-0.5 and float(q[..., 72:].abs().sum() + v[..., 72:].abs().sum()) == 0.0
        b = cu.tolist()
        return torch.cat([  # the given scale, as FA3 takes it (not one from the padded size)
            torch.nn.functional.scaled_dot_product_attention(
                *(t[s:e].transpose(0, 1) for t in (q, k, v)), scale=scale
            ).transpose(0, 1)
            for s, e in zip(b[:-1], b[1:], strict=True)
        ])  # fmt: skip

    layer.packed = only_multiples_of_16
    out = layer._on_packed(q, k, v, seg)
    assert out is not None and out.shape == (20, 2, 80) and dims == [72, 80] and layer.packed_pad == 8
    torch.testing.assert_close(out[..., :72], _grouped_sdpa(q, k, v, seg), rtol=1e-5, atol=1e-5)
    assert not out[..., 72:].any()  # v's zero columns: the output keeps them for the padded projection
    assert layer._on_packed(q, k, v, seg) is not None and dims == [72, 80, 80]  # padded from then on, no retry

    refusing = VisionAttention(144, 2)
    refusing.packed = lambda *args: (_ for _ in ()).throw(RuntimeError("no kernel"))
    assert refusing._on_packed(q, k, v, seg) is None and refusing.packed is None


def test_fa3_without_a_kernel_serves_on_the_default_backend(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        backend = get_attention_backend("fa3", "cpu")
    assert backend.name == "sdpa"
    assert "FlashAttention-3 unavailable" in caplog.text
    assert unavailable_reason(torch.device("cpu"))


def test_fa3_only_when_asked_auto_never_loads_the_fork_s_library(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert get_attention_backend("auto", "cpu").name == "sdpa"  # no GPU here: quietly the default
    assert "FlashAttention-3" not in caplog.text
    monkeypatch.setattr(fa3_attention, "unavailable_reason", lambda device: "")
    monkeypatch.setattr(fa3_attention, "_load", lambda: (reference_kernel, ""))
    assert get_attention_backend("fa3", "cpu").name == "fa3"
    assert get_attention_backend("auto", "cpu").name == "sdpa"  # a build on the host changes nothing for auto
    assert get_attention_backend("sdpa", "cpu").name == "sdpa"
    assert fa3_attention.vision_kernel("fa3", "cpu") is fa3_attention.packed_kernel
    assert fa3_attention.vision_kernel("auto", "cpu") is None and fa3_attention.vision_kernel("flash", "cpu") is None


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


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or bool(unavailable_reason(torch.device("cuda"))),
    reason="needs a CUDA device with an FA3 build of vLLM's flash-attention installed",
)
def test_fa3_on_blocks_of_whole_key_tiles_matches_flash_attention_2() -> None:
    """Blocks of 128 tokens (`glimpse serve`'s CUDA default) on the 7B's heads: FA3 loads them with TMA, not the
    gather that blocks of 16 take, so this is a kernel path of its own. Decodes, a long chunk, a fresh prompt."""
    from tests.workers.engine.kernels.test_paged_attention import cuda_step

    torch.manual_seed(0)
    d = 128
    seq_lens = [int(n) for n in torch.randint(1, 3000, (6,))] + [2900, 300]
    q, k, v, cache, meta = cuda_step([1] * 6 + [700, 300], seq_lens, 128, 200)
    expected_cache = cache.clone()
    expected = FlashVarlenBackend().forward(q, k, v, expected_cache, meta, d**-0.5)
    out = get_attention_backend("fa3", "cuda").forward(q, k, v, cache, meta, d**-0.5)
    assert torch.equal(cache, expected_cache)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def engine_matches_transformers(model_dir: Path, attn_backend: str, count: int) -> Any:
    """An engine on ``attn_backend`` answers ``count`` chats (text, and up to two images, in chunks of 32 tokens) with
    transformers' greedy tokens; the engine, for what the caller checks next."""
    requests = [chat("Short one." * (1 + i), [noise_image(60 + 30 * i, 90 - 5 * i, seed=100 + i)] * (i % 3))
                for i in range(count)]
    engine = make_engine(model_dir, chunk_size=32, attn_backend=attn_backend)
    outs = engine.generate(requests, GREEDY)
    reference = Reference(model_dir)
    for messages, out in zip(requests, outs, strict=True):
        assert out.token_ids == reference.generate(messages)
    return engine


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
    engine = engine_matches_transformers(demo_model_dir, "fa3", 5)
    assert max(calls) > 1  # steps with several sequences went through the kernel
    # the tower's attention layers got FA3's packed call (used on its CUDA path; see the GPU test below)
    layers = [m for m in engine.runner.vision.modules() if isinstance(m, VisionAttention)]
    assert layers and all(m.packed is fa3_attention.packed_kernel for m in layers)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or bool(unavailable_reason(torch.device("cuda"))),
    reason="needs a CUDA device with an FA3 build of vLLM's flash-attention installed",
)
@pytest.mark.parametrize(("frames", "hidden"), [(False, 1280), (True, 1280), (True, 1152)])
def test_vit_attention_on_packed_matches_its_default_kernels(frames: bool, hidden: int) -> None:
    """A ViT attention layer (16 heads of 80, or Qwen3-VL's 72) given FA3's packed call: whole frames run on it and
    match the default kernels (FA2 varlen; cuDNN once a length is hot) in bf16; windows (ragged at the edges) keep
    their own kernel, where FA3 measured slower, so their output is the default's bit for bit and the packed call is
    never made."""
    torch.manual_seed(0)
    layer = VisionAttention(hidden, 16).cuda().bfloat16()
    lengths = ([4 * 4 * 4] * 5 + [4 * 3 * 4, 4 * 1 * 4, 2 * 4 * 4]) * 2 if not frames else [1380, 2356]
    bounds = list(accumulate(lengths, initial=0))
    seg = Segments(torch.tensor(bounds, dtype=torch.int32, device="cuda"), bounds, max(lengths), frames=frames)
    n = bounds[-1]
    x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(n, hidden // 32, device="cuda") * 6
    cos, sin = angles.cos(), angles.sin()
    calls = []

    def packed(*args: Any) -> Tensor:
        calls.append(args[3])
        return fa3_attention.packed_kernel(*args)

    with torch.inference_mode():
        expected = layer(x, seg, cos, sin, flash=True)
        layer.packed = packed
        out = layer(x, seg, cos, sin, flash=True)
    if frames:
        assert calls and all(c.tolist() == bounds for c in calls) and layer.packed is not None
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    else:
        assert not calls and torch.equal(out, expected)


# The fork's FA3 ``fwd`` schema as vLLM 0.24 registers it (flash_attn_interface.py's FA3 call, in its order).
FWD_SCHEMA = (
    "fwd(Tensor q, Tensor k, Tensor v, Tensor? k_new, Tensor? v_new, Tensor? q_v, Tensor? out, "
    "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? cu_seqlens_k_new, Tensor? seqused_q, Tensor? seqused_k, "
    "int? max_seqlen_q, int? max_seqlen_k, Tensor? page_table, Tensor? kv_batch_idx, Tensor? leftpad_k, "
    "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? seqlens_rotary, Tensor? q_descale, Tensor? k_descale, "
    "Tensor? v_descale, float? softmax_scale, bool is_causal, int window_size_left, int window_size_right, "
    "float softcap, bool is_rotary_interleaved, Tensor? scheduler_metadata, int num_splits, bool? pack_gqa, "
    "int sm_margin, Tensor? s_aux, int cp_world_size, int cp_rank, Tensor? cp_tot_seqused_k) -> Tensor[]"
)


def test_the_fork_s_op_library_loads_without_its_python_or_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork's Python imports vLLM, and vLLM's package import has side effects, so only the compiled op library
    is loaded: from inside an installed vLLM, or from the folder GLIMPSE_FA3_PATH names. A stand-in library
    registers the fork's ``fwd`` schema with the reference kernel behind it, so the positional call is checked
    argument by argument."""
    namespace = "_glimpse_test_fa3_C"
    monkeypatch.setattr(fa3_attention, "LIBRARY", namespace)
    installed, elsewhere = tmp_path / "site" / "vllm" / "vllm_flash_attn", tmp_path / "own" / "vllm_flash_attn"
    for fork in (installed, elsewhere):
        fork.mkdir(parents=True)
        (fork.parent / "__init__.py").write_text("raise RuntimeError('python beside the fork was run')\n")
        (fork / "__init__.py").write_text("raise RuntimeError('the fork itself was run')\n")
        (fork / f"{namespace}.abi3.so").write_bytes(b"")
    seen: list[list[Any]] = []

    def fwd(*args: Any) -> list[Tensor]:
        seen.append(list(args))
        q, k, v, cu_q, used, max_q, max_k, table, scale, causal = (args[i] for i in (0, 1, 2, 7, 11, 12, 13, 14, 23, 24))
        rest = [a for i, a in enumerate(args) if i not in (0, 1, 2, 7, 11, 12, 13, 14, 23, 24)]
        assert rest == [None] * 15 + [-1, -1, 0.0, True, None, 0, None, 0, None, 1, 0, None]
        out = reference_kernel(q, k, v, max_q, cu_q, max_k, seqused_k=used, block_table=table, softmax_scale=scale,
                               causal=causal, fa_version=3)
        return [out, torch.zeros(1)]

    library = torch.library.Library(namespace, "DEF")
    loaded: list[str] = []

    def load_library(path: str) -> None:
        loaded.append(path)
        if len(loaded) == 1:
            library.define(FWD_SCHEMA)
            library.impl("fwd", fwd, "CPU")

    monkeypatch.setattr(torch.ops, "load_library", load_library)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    q, k, v, cache, meta = mixed_step("cpu", torch.bfloat16)
    for env, want in ((None, installed), (str(elsewhere.parent), elsewhere)):
        if env is not None:
            monkeypatch.setenv("GLIMPSE_FA3_PATH", env)
        fa3_attention._load.cache_clear()
        try:
            kernel, reason = fa3_attention._load()
        finally:
            fa3_attention._load.cache_clear()
        assert reason == "" and kernel is not None and Path(loaded[-1]).parent == want
        out = FA3PagedBackend(kernel=kernel, any_device=True).forward(q, k, v, cache.clone(), meta, D**-0.5)
        expected = SdpaBackend().forward(q, k, v, cache.clone(), meta, D**-0.5)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert "vllm" not in sys.modules and len(seen) == 2


def test_a_fork_op_with_another_argument_order_is_refused() -> None:
    class Arg:
        def __init__(self, name: str) -> None:
            self.name = name

    class Op:
        class default:
            class _schema:
                arguments = [Arg(n.split()[-1]) for n in FWD_SCHEMA[4:].split(") ->")[0].split(", ")]

    assert fa3_attention._check_schema(Op) == ""
    Op.default._schema.arguments[11], Op.default._schema.arguments[10] = (
        Op.default._schema.arguments[10], Op.default._schema.arguments[11])
    assert "11: seqused_q (want seqused_k)" in fa3_attention._check_schema(Op)
    Op.default._schema.arguments.pop()
    assert "36 arguments" in fa3_attention._check_schema(Op)
