"""Filling a built model (base.py's ``VLModel``) with its weights: one walk over the checkpoint's safetensors shards
for both towers, FP8 checkpoints read dequantized and their FP8 layers remade where the GPU runs FP8 GEMMs, or
deterministic random weights for ``--load-format dummy``."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from workers.engine.kernels import fp8_gemm
from workers.engine.models.base import VLModel
from workers.engine.models.fp8_layers import convert_dummy, convert_loaded
from workers.engine.models.fp8_streaming import StreamingFp8
from workers.engine.models.loader import fill_dummy_weights, iter_checkpoint, normalize_name
from workers.engine.models.quantization import Fp8Record, checkpoint_scheme, dequantized

log = logging.getLogger("glimpse.model")

# Whether a thread moves each checkpoint tensor to the GPU, one tensor ahead of the loaders that place it
# (``on_device_ahead``); off by default until measured (benchmarks/engine/load_bench.py's "ahead" variant).
LOAD_AHEAD = os.environ.get("GLIMPSE_LOAD_AHEAD", "0") == "1"


def load_model(
    model: VLModel,
    model_dir: str | Path,
    *,
    load_format: str = "auto",
    seed: int = 0,
    rank: int = 0,
) -> VLModel:
    """Fill ``model`` from the checkpoint in one walk over its safetensors shards (``lm.*`` tensors to the
    language model, ``visual.*`` to the vision tower), or with deterministic random weights (``dummy``). A model
    built without its tower (``VLModel.vision`` None) never reads a ``visual.*`` tensor: the name filter skips them
    on the shard's header, as ``load_vision`` skips the language model's.

    An FP8 checkpoint (quantization.py) is read dequantized, so every weight reaches its loader in float32 and lands
    in the model dtype; on a GPU with FP8 GEMMs the language model's FP8 layers are then made FP8 again
    (fp8_layers.py). The vision tower always stays in the model dtype."""
    started = time.perf_counter()
    if load_format == "dummy":
        fill_dummy_weights(model.lm, seed=seed + rank)  # LM shards differ per rank
        if model.vision is not None:
            fill_dummy_weights(model.vision, seed=seed)  # the ViT is replicated: every rank the same weights
        if (dummy_scheme := checkpoint_scheme(model_dir)) is not None:  # FP8 serving measured without a checkpoint
            convert_dummy(model.lm, dummy_scheme.block, rank)
    elif load_format == "auto":
        # One walk over the shards: language-model tensors stream straight into their (sharded) parameters,
        # so host memory holds one tensor at a time even for a 235B checkpoint; the vision tower's tensors
        # (a few GB at most) are kept aside and loaded once the walk is done.
        vision_weights: list[tuple[str, Tensor]] = []
        nbytes = 0
        scheme = checkpoint_scheme(model_dir)
        fp8_record: Fp8Record = {}  # the FP8 weights' scales, for fp8_layers
        wanted = None if model.vision is not None else _not_visual

        def stored() -> Iterator[tuple[str, Tensor]]:
            nonlocal nbytes
            for name, tensor in iter_checkpoint(model_dir, name_filter=wanted, show_progress=rank == 0):
                nbytes += tensor.numel() * tensor.element_size()  # as stored: FP8 bytes, not the dequantized ones
                yield name, tensor

        # Built with its weights deferred (defers_lm_weights): FP8 module by module as the walk fills them.
        streaming = StreamingFp8(model.lm, scheme.block) if scheme is not None and _deferred(model.lm) else None

        def lm_weights() -> Iterator[tuple[str, Tensor]]:
            stream = stored()
            stream = dequantized(stream, scheme, fp8_record) if scheme is not None else stream
            if LOAD_AHEAD and (device := _device_of(model.lm)).type == "cuda":
                stream = on_device_ahead(stream, device)
            for name, tensor in stream:
                canonical = normalize_name(name)
                if canonical.startswith("lm."):
                    if streaming is not None:
                        streaming.before(canonical)
                    yield canonical, tensor  # (resumed once the model's loader has copied it in)
                    if streaming is not None:
                        streaming.after(canonical, fp8_record.pop(name, None))
                elif canonical.startswith("visual."):
                    vision_weights.append((canonical[len("visual.") :], tensor))
                # Anything else (e.g. a multi-token-prediction head) is not part of serving.

        model.lm.load_weights(lm_weights())
        if model.vision is not None:
            model.vision.load_weights(vision_weights)
        if streaming is not None:
            streaming.finish(rank)
        elif scheme is not None:
            convert_loaded(model.lm, {normalize_name(n): v for n, v in fp8_record.items()}, scheme.block, rank)
        if rank == 0:
            log.info(
                "loaded %.2f GB of weights from %s in %.1f s",
                nbytes / 1e9,
                model_dir,
                time.perf_counter() - started,
            )
    else:
        raise ValueError(f"unknown load_format {load_format!r}")
    model.after_load()
    return model.eval()


def defers_lm_weights(model_dir: str | Path, load_format: str, device: torch.device) -> bool:
    """Whether to build the language model with its weights deferred (layers/deferred.py), for ``load_model`` to
    make it FP8 while it loads: an FP8 checkpoint on a device that gets FP8 layers."""
    return load_format == "auto" and checkpoint_scheme(model_dir) is not None and fp8_gemm.wants_fp8_layers(device)


def on_device_ahead(stream: Iterator[tuple[str, Tensor]], device: torch.device) -> Iterator[tuple[str, Tensor]]:
    """``stream``'s tensors on ``device``, each copied by a thread while the loaders place the one before: the host's
    page reads and staging copies overlap the placing, and every slice and transpose after runs on the GPU. One
    tensor waits ahead, so at most two whole checkpoint tensors are on the GPU beside the parameters."""
    ahead: queue.Queue[tuple[str, Tensor] | BaseException | None] = queue.Queue(maxsize=1)
    stop = threading.Event()

    def put(item: tuple[str, Tensor] | BaseException | None) -> bool:
        """Hand ``item`` over; False once the loading thread has stopped taking them."""
        while not stop.is_set():
            try:
                ahead.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def feed() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            for name, tensor in stream:
                if not put((name, tensor.to(device))):
                    return
            put(None)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the loading thread
            put(exc)

    thread = threading.Thread(target=feed, name="load-ahead", daemon=True)
    thread.start()
    try:
        while (item := ahead.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cpu")


def _deferred(lm: nn.Module) -> bool:
    return any(p.is_meta for p in lm.parameters())


def _not_visual(name: str) -> bool:
    return not normalize_name(name).startswith("visual.")


def load_vision(
    tower: Any, model_dir: str | Path, *, load_format: str = "auto", seed: int = 0
) -> nn.Module:
    """Fill a vision tower built alone (``ModelFamily.build_tower``: an encoder worker's; typed loosely, as VLModel
    holds its tower) from the checkpoint's ``visual.*`` tensors. The language model's are skipped before they are
    read (the name filter runs on the header), so an encoder reads a few GB of a 235B checkpoint, not all of it.
    FP8 weights arrive dequantized, as in ``load_model``. ``dummy`` fills the tower as ``load_model`` does (the same seed), so an encoder worker and
    a model worker of one launch hold the same random tower."""
    started = time.perf_counter()
    if load_format == "dummy":
        fill_dummy_weights(tower, seed=seed)
    elif load_format == "auto":
        scheme = checkpoint_scheme(model_dir)

        def visual(name: str) -> bool:
            return normalize_name(name).startswith("visual.")

        stream = iter_checkpoint(model_dir, name_filter=visual)
        weights = [
            (normalize_name(name)[len("visual.") :], tensor)
            for name, tensor in (dequantized(stream, scheme, {}) if scheme is not None else stream)
        ]
        tower.load_weights(weights)
        log.info("loaded the vision tower (%d tensors) from %s in %.1f s", len(weights), model_dir,
                 time.perf_counter() - started)
    else:
        raise ValueError(f"unknown load_format {load_format!r}")
    hook = getattr(tower, "after_load", None)
    if hook is not None:
        hook()
    return tower.eval()
