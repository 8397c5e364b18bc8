"""Run under ``TRITON_INTERPRET=1`` by test_fp8_kv_cache.py: the Triton paged decode kernel and the KV write kernel
over an FP8 cache (per-head scales), against an independent float64 reference over the e4m3 round trip.

A separate process because Triton reads TRITON_INTERPRET when ``triton.language`` is imported."""

from __future__ import annotations

import torch
from torch import Tensor

from workers.engine.kernels import kv_quant, kv_write_kernel, paged_attention


def round_trip(x: Tensor, scale: Tensor) -> Tensor:
    """The reference's e4m3 round trip, written apart from kv_quant: x / s saturated, to e4m3 and back, times s."""
    y = torch.clamp(x.double() / scale.double().view(-1, 1), min=-448.0, max=448.0)
    return y.to(torch.float8_e4m3fn).double() * scale.double().view(-1, 1)


def check_decode(window: int) -> float:
    hq, hkv, d, block_size, width = 6, 2, 16, 4, 5
    gen = torch.Generator().manual_seed(window)
    seq_lens = [1, 7, 13, 20]
    scales = torch.tensor([[0.02, 0.5], [3.0, 0.01]])
    values = torch.randn(2, len(seq_lens) * width + 1, block_size, hkv, d, generator=gen) * 4
    cache = torch.stack([kv_quant.quantize(values[i], scales[i]) for i in (0, 1)])
    kv_quant.attach_scales(cache, scales)
    tables = torch.arange(len(seq_lens) * width).view(len(seq_lens), width).flip(1).int()
    q = torch.randn(len(seq_lens), hq, d, generator=gen)
    out = paged_attention.paged_decode(q, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), 0.25,
                                       width * block_size, window=window)
    worst = 0.0
    for b, n in enumerate(seq_lens):
        first = max(0, n - window) if window else 0
        slots = [int(tables[b, p // block_size]) * block_size + p % block_size for p in range(first, n)]
        flat = values.view(2, -1, hkv, d)
        k = round_trip(flat[0, slots], scales[0]).repeat_interleave(hq // hkv, 1)
        v = round_trip(flat[1, slots], scales[1]).repeat_interleave(hq // hkv, 1)
        probs = (torch.einsum("hd,khd->hk", q[b].double(), k) * 0.25).softmax(-1)
        worst = max(worst, (out[b].double() - torch.einsum("hk,khd->hd", probs, v)).abs().max().item())
    return worst


def check_write() -> None:
    gen = torch.Generator().manual_seed(1)
    scales = torch.tensor([[0.5, 2.0], [0.1, 1.0]])
    k, v = (torch.randn(5, 2, 16, generator=gen) * 50 for _ in range(2))  # some past 448 * scale: saturated
    cache = torch.zeros(2, 4, 4, 2, 16, dtype=kv_quant.FP8)
    kv_quant.attach_scales(cache, scales)
    slots = torch.tensor([7, 0, 12, 3, 9])
    kv_write_kernel.write(kv_quant.quantize(k, scales[0]).view(torch.uint8),
                          kv_quant.quantize(v, scales[1]).view(torch.uint8), cache.view(torch.uint8), slots)
    flat = cache.view(2, -1, 2, 16).double() * scales.double().view(2, 1, 2, 1)
    assert torch.equal(flat[0, slots], round_trip(k, scales[0])) and torch.equal(flat[1, slots], round_trip(v, scales[1]))


if __name__ == "__main__":
    for w in (0, 6):
        err = check_decode(w)
        assert err < 1e-5, (w, err)
    check_write()
    print("ok")
