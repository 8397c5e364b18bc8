"""The hand-written Triton kernels' start-up probes (kernels/triton_switch.py): each kernel runs once against its
reference before the worker serves, so a card or an install it fails on gets the kernel's fallback and one warning
naming it, rather than a failed request.

The probes run at the same time, on threads. On a host whose Triton cache is empty (a new machine or container) each
probe is a compile (MLIR passes, LLVM, ptxas: 0.05-0.8 s, mostly outside the GIL): the eleven of a hybrid model took
10.5 s one after another and 3.1 s on threads (H200, empty cache, bf16). With the cache filled they load in a few ms.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from workers.engine.kernels import (
    causal_conv,
    conv_decode,
    gated_delta_decode,
    hybrid_kernels,
    kv_write_kernel,
    moe_batched,
    moe_kernel,
    rope_kernel,
    silu_kernel,
    skinny_gemm,
    split_norm,
    vit_kernels,
    window_attention,
)
from workers.engine.kernels.launch_helpers import worker_thread
from workers.engine.kernels.triton_switch import TritonSwitch

log = logging.getLogger("glimpse.model")


@dataclass(frozen=True)
class Probe:
    run: Callable[[torch.device, torch.dtype], bool]
    switch: TritonSwitch
    off: str  # the warning when the kernel is off: %s is why (TritonSwitch.why_off), then what serves instead


# The kernels a vision tower calls (a model worker's or an encoder worker's).
TOWER = (
    Probe(silu_kernel.probe, silu_kernel.SWITCH, "the Triton SiLU*up kernel is off (%s); the compiled one serves"),
    Probe(window_attention.probe, window_attention.SWITCH,
          "the Triton window attention is off (%s); FlashAttention varlen serves the ViT's windows"),
    Probe(vit_kernels.probe, vit_kernels.SWITCH,
          "the Triton ViT rotary and position embedding are off (%s); the compiled ones serve"),
)
SKINNY = Probe(skinny_gemm.probe, skinny_gemm.SWITCH,
               "the Triton skinny GEMM is off (%s); cuBLAS serves decode rows")
# The language model's (every family).
LM = (
    SKINNY,
    Probe(split_norm.probe, split_norm.SWITCH,
          "the Triton split-K norm is off (%s); decode projections sum their own partials"),
    Probe(split_norm.probe_rows, split_norm.ROWS_SWITCH, "the Triton RMSNorm is off (%s); the compiled norm serves"),
    Probe(kv_write_kernel.probe, kv_write_kernel.SWITCH, "the Triton KV-cache write is off (%s); index_copy_ serves"),
    Probe(rope_kernel.probe, rope_kernel.SWITCH, "the Triton LM rotary kernel is off (%s); the compiled one serves"),
    Probe(moe_kernel.probe, moe_kernel.SWITCH, "the Triton MoE decode kernels are off (%s); grouped GEMMs serve"),
    Probe(moe_kernel.probe_batched, moe_batched.SWITCH,
          "the Triton MoE kernels for decode batches are off (%s); grouped GEMMs serve them"),
)
# A hybrid model's Gated DeltaNet layers.
RECURRENT = (
    Probe(gated_delta_decode.probe, gated_delta_decode.SWITCH,
          "the Triton gated delta decode kernel is off (%s); fla's or torch's step serves"),
    Probe(causal_conv.probe, causal_conv.SWITCH,
          "the Triton causal conv is off (%s); the torch conv serves steps with prefill"),
    Probe(conv_decode.probe, conv_decode.SWITCH,
          "the Triton decode conv is off (%s); the compiled conv serves decode steps"),
    Probe(hybrid_kernels.probe, hybrid_kernels.SWITCH,
          "the Triton gated-attention and Gated DeltaNet elementwise kernels are off (%s); the compiled ones serve"),
)


def probe_kernels(probes: Sequence[Probe], device: torch.device, dtype: torch.dtype) -> list[bool]:
    """Run ``probes`` on ``device``; whether each kernel stays on (in order). One warning per kernel turned off."""

    def run(probe: Probe) -> bool:
        with worker_thread(device):
            return probe.run(device, dtype)

    if not probes:
        return []
    # The first alone: it sets up Triton's driver and launcher utilities, which the others would race to build.
    results = [run(probes[0])]
    if len(probes) > 1:
        with ThreadPoolExecutor(len(probes) - 1, thread_name_prefix="triton-probe") as pool:
            results += pool.map(run, probes[1:])
    for on, probe in zip(results, probes, strict=True):
        if not on:
            log.warning(probe.off, probe.switch.why_off())
    return results
