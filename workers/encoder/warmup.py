"""An encoder worker's start-up on CUDA: its tower gets what a model worker's warm-up gives its own
(workers/engine/runner/warmup.py) before the worker announces itself ready.

- The ViT attention's first use (cuDNN frames), as `warm_tower_attention` does for a model worker.
- The fused kernels (``--no-fused-kernels`` turns them off, as for the model workers): the tower's norms, rotary,
  SiLU·up (and Gemma 4's layer pieces) as compiled kernels, compiled here by three ViT calls. Without this an encoder
  worker ran every ViT eagerly: on an H200 one 1080p image through Gemma 4's tower took 41.9 ms eager against 29.0
  with its compiled pieces, eight 175.1 against 77.7 ms (``python -m benchmarks.engine.gemma4_vit_bench``).
- ViT calls at the step's and the common images' patch counts (`vit_calls`), so that the caching allocator holds
  their activations and cuBLAS has picked their GEMM kernels before the first job.
A failure in either of the last two is logged and the worker serves without it (eagerly, or paying the first use).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from workers.engine.config import EngineConfig
from workers.engine.kernels import fused
from workers.engine.models.model_spec import ModelSpec
from workers.engine.runner.batching import patches
from workers.engine.runner.kernel_probes import TOWER, probe_kernels
from workers.engine.runner.warmup import fused_grids, run_vit_calls, vit_calls, warm_tower_attention

log = logging.getLogger("glimpse.encoder")


@torch.inference_mode()
def warm_encoder_tower(tower: nn.Module, spec: ModelSpec, cfg: EngineConfig, dtype: torch.dtype,
                       device: torch.device) -> bool:
    """The tower ready to take jobs on ``device`` (CUDA); returns whether its fused kernels are on."""
    warm_tower_attention(tower, device, dtype)
    on = cfg.fused_kernels and _fused_on(tower, spec, dtype, device)
    started = time.perf_counter()
    try:
        calls = vit_calls(spec.spatial_merge_size, getattr(spec.vision, "patch_size", 0), cfg.vit_max_patches)
        done, _ = run_vit_calls(tower, calls, spec.patch_dim, dtype, device)
        torch.cuda.synchronize(device)
    except Exception as exc:  # torch.OutOfMemoryError included: the first large job will say so itself
        torch.cuda.empty_cache()
        log.warning("the encoder's ViT warm-up failed (%s); its first large jobs pay their allocations", exc)
        return on
    log.info("encoder ViT warmed in %.2f s (calls of %s patches, fused kernels %s)", time.perf_counter() - started,
             done, "on" if on else "off")
    return on


def _fused_on(tower: nn.Module, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> bool:
    """Switch the tower's fused kernels on and compile them; eager (off) again if that fails."""
    probe_kernels(TOWER, device, dtype)
    started = time.perf_counter()
    fused.enable(tower)
    try:
        with fused.forced():
            for grid in fused_grids(spec.spatial_merge_size):
                tower(torch.zeros(patches(grid), spec.patch_dim, dtype=dtype, device=device), [grid])
        torch.cuda.synchronize(device)
    except Exception as exc:  # e.g. no C compiler for Triton's launcher: encode eagerly rather than not at all
        fused.enable(tower, False)
        log.warning("the encoder's fused kernels are unavailable, running eager ops: %s", exc, exc_info=True)
        return False
    log.info("encoder fused kernels ready in %.1f s", time.perf_counter() - started)
    return True
