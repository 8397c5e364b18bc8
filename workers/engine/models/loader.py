"""Checkpoint access shared by the language model and the vision tower.

Two weight namings exist for Qwen2.5-VL on disk:
* original Qwen / transformers 4.x checkpoints: ``model.layers.N...``, ``model.embed_tokens``,
  ``model.norm``, ``lm_head.weight``, ``visual.*``;
* transformers 5 module layout: ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``
  (5.x still *saves* the original names, but both appear in the wild).
``normalize_name`` maps either to one canonical form: ``lm.*`` for every language-model weight
(``lm.lm_head.weight`` included) and ``visual.*`` for the vision tower.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

# Longest prefixes first: "model.visual." and "model.language_model." must win over "model.".
_PREFIX_RULES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "lm."),
    ("language_model.model.", "lm."),  # some intermediate 4.x exports
    ("language_model.lm_head.", "lm.lm_head."),
    ("model.visual.", "visual."),
    # Gemma 4: the vision tower and its multimodal embedder are the family's tower; the E models' audio tower is
    # not served (no lm./visual. prefix: the walk drops it).
    ("model.vision_tower.", "visual.vision_tower."),
    ("model.embed_vision.", "visual.embed_vision."),
    ("model.audio_tower.", "audio.audio_tower."),
    ("model.embed_audio.", "audio.embed_audio."),
    ("visual.", "visual."),
    ("lm_head.", "lm.lm_head."),
    ("model.", "lm."),
)


def normalize_name(name: str) -> str:
    """Map a checkpoint tensor name (either naming) to the canonical ``lm.*`` / ``visual.*`` form.

    Names matching no rule are returned unchanged.
    """
    for prefix, canonical in _PREFIX_RULES:
        if name.startswith(prefix):
            return canonical + name[len(prefix) :]
    return name


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be read as a whole (missing or truncated shard, bad index)."""


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those named by ``model.safetensors.index.json`` if present."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from None
        files = [root / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{root}: {len(missing)} of {len(files)} shards named in model.safetensors.index.json are "
                f"missing: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
            )
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {root}")
    return files


def check_checkpoint(model_dir: str | Path) -> int:
    """Check every shard is there and whole, from the headers alone (milliseconds, no tensor is read), so a
    bad download stops start-up with one line before any worker spends minutes loading. Returns the bytes of
    tensor data the shards hold."""
    total = 0
    for path in safetensors_files(model_dir):
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                if not 0 < header_len <= size - 8:
                    raise ValueError(f"header length {header_len} does not fit a {size}-byte file")
                header = json.loads(f.read(header_len))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"cannot read shard {path}: {exc}") from None
        if 8 + header_len + end > size:
            raise CheckpointError(
                f"shard {path} is truncated: {size} bytes on disk, its header describes {8 + header_len + end}"
            )
        total += end
    return total


def iter_safetensors(
    model_dir: str | Path, name_filter: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, cpu_tensor)`` for every tensor in the checkpoint, as stored (names not normalized).

    ``name_filter`` is applied to the stored name before the tensor is read, so skipped tensors
    cost no I/O.
    """
    yield from iter_checkpoint(model_dir, name_filter=name_filter)


def iter_checkpoint(
    model_dir: str | Path, name_filter: Callable[[str], bool] | None = None, show_progress: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """``iter_safetensors`` with a progress bar over the shards (on a terminal, or when asked) and one clear
    ``CheckpointError`` line for a shard that cannot be read (truncated, corrupt) instead of a traceback."""
    files = safetensors_files(model_dir)
    bar = None
    if show_progress and len(files) > 1:
        from tqdm import tqdm  # transformers' own dependency; only for the bar

        bar = tqdm(total=len(files), desc="loading safetensors shards", unit="shard", leave=False)
    try:
        for path in files:
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                        if name_filter is None or name_filter(name):
                            yield name, f.get_tensor(name)
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own error types for short or corrupt files
                raise CheckpointError(f"cannot read shard {path}: {exc} (truncated or corrupt download?)") from None
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


# Multiplicative gains that are not norms but must start at 1 too (Gemma 4's per-layer scalar and router scales):
# N(0, 0.02) there would shrink the residual stream at every layer of a dummy-weight model.
_UNIT_GAINS = ("layer_scalar", "scale", "per_expert_scale")


def is_norm_param(name: str) -> bool:
    """True for weights/biases of normalization layers (their module name contains "norm") and for the unit gains
    above (filled with 1 like a norm's weight)."""
    parts = name.split(".")
    return (len(parts) >= 2 and "norm" in parts[-2]) or parts[-1] in _UNIT_GAINS


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter with deterministic random values, for benchmarks without a checkpoint.

    Linear/embedding weights and biases get N(0, std); norm weights get 1 and norm biases 0, so
    activations keep a realistic scale through deep stacks. Values are drawn on the parameter's
    own device (fast for 7B-sized models on GPU); ``seed`` should differ per TP rank.
    """
    for i, (name, param) in enumerate(model.named_parameters()):
        if is_norm_param(name):
            param.fill_(1.0 if name.endswith(("weight", *_UNIT_GAINS)) else 0.0)
            continue
        gen = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + i)
        if param.dtype.is_floating_point and param.element_size() >= 4:
            param.normal_(0.0, std, generator=gen)
        else:  # draw in float32 and round, so the stream does not depend on the storage dtype
            param.copy_(torch.empty(param.shape, device=param.device).normal_(0.0, std, generator=gen))
