"""Host-side batching helpers of the model runner: staging host tensors onto the device, splitting a
step's images into ViT calls and over TP ranks."""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ipc.steps import EncodeItem
from workers.engine.prompt.pixel_frames import FrameLayout

T = TypeVar("T")


def to_device(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Concatenate host tensors onto ``device`` without blocking the host.

    A copy from pageable memory waits until the GPU has drained the stream, so the CPU could not
    prepare the next step (or the next image) while the GPU runs this one. Staged through pinned
    memory the copy is queued like a kernel; torch's pinned-memory cache keeps the staging buffer
    alive until the copy is done.
    """
    if device.type != "cuda":
        return torch.cat(parts).to(device)
    rows = sum(p.shape[0] for p in parts)
    staged = torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype, pin_memory=True)
    torch.cat(parts, out=staged)
    return staged.to(device, non_blocking=True)


def queued_to_host(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Copies of device tensors in pinned host memory, queued behind the work that makes them (the host does not
    wait), and the event recorded after the copies: read them once it has passed. Off CUDA: the tensors as they
    are, no event."""
    if not tensors or tensors[0].device.type != "cuda":
        return list(tensors), None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def pixel_rows(parts: list[torch.Tensor], device: torch.device, dtype: torch.dtype, layout: FrameLayout | None) -> torch.Tensor:
    """A ViT call's patch rows on ``device`` in ``dtype``, from what the images' segments hold: rows, or uint8
    frames (pixel_frames.py), each copied as it is (a quarter of the rows' bytes in bf16) and made into rows there."""
    if all(p.dtype != torch.uint8 for p in parts):
        return to_device(parts, device).to(dtype)
    if layout is None:
        raise ValueError("an image's segment holds a uint8 frame, but this checkpoint's processor has no frame layout")
    rows = [layout.rows(to_device([p], device), dtype) if p.dtype == torch.uint8 else to_device([p], device).to(dtype)
            for p in parts]
    return torch.cat(rows) if len(rows) > 1 else rows[0]


def patches(grid: tuple[int, int, int]) -> int:
    return grid[0] * grid[1] * grid[2]


def group_by_patches(items: list[EncodeItem], max_patches: int) -> list[list[EncodeItem]]:
    """Consecutive runs of ``items`` of at most ``max_patches`` patches each (an image larger than that
    gets a run of its own), so a step's ViT transient is bounded by the cap, not by how many images it has."""
    return consecutive_runs(items, lambda item: patches(item.grid), max_patches)


def consecutive_runs(items: Sequence[T], size: Callable[[T], int], most: int) -> list[list[T]]:
    """``items`` in order, cut into consecutive runs whose ``size`` adds up to at most ``most`` (an item larger
    than that gets a run of its own)."""
    runs: list[list[T]] = []
    total = most + 1
    for item in items:
        n = size(item)
        if total + n > most:
            runs.append([])
            total = 0
        runs[-1].append(item)
        total += n
    return runs


def split_by_patches(patches: list[int], ranks: int) -> list[list[int]]:
    """Assign item indices to ranks, largest first, each to the least-loaded rank (deterministic, so
    every rank computes the same split without talking)."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(i)
        load[rank] += patches[i]
    for share in shares:
        share.sort()  # keep prompt order inside a share
    return shares


def cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


# A step's index fields run to tokens x 5 integers (ids, three position rows, slots); torch.tensor converts a list
# at ~130 ns an element, array.array at ~20 (12,000 ints: 3.2 against 0.46 ms on the dev box), so a 4,096-token
# prefill step's host time loses ~5 ms that a host-bound step (a MoE's) waits out.
_TYPECODES = {torch.int64: "q", torch.int32: "i"}
_ZEROS = [0] * 16


# Triton compiles one variant of a kernel per alignment class of its pointer arguments (16 bytes or not). The
# step's index fields are packed into one copy, so each starts on a 16-byte boundary: otherwise a field's offset
# follows the batch size, and the paged decode kernel met unaligned block tables and lengths only under load,
# compiling two more variants mid-serving (~0.7 s each, stalling a fresh server's first loaded steps on an H200).
def aligned_pack(parts: Sequence[Sequence[int]], per_16_bytes: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``parts`` end to end in one host tensor of ``dtype`` (int64 or int32), each padded with zeros to a multiple of
    ``per_16_bytes`` elements."""
    if not 0 < per_16_bytes <= len(_ZEROS):
        raise ValueError(f"per_16_bytes={per_16_bytes}: 1..{len(_ZEROS)}")
    flat = int_array(dtype)
    for part in parts:
        flat.extend(part)
        flat.extend(_ZEROS[: -len(part) % per_16_bytes])
    return host_tensor(flat, dtype)


def int_array(dtype: torch.dtype = torch.int64) -> array.array[int]:
    """An empty array.array of ``dtype``'s C integer type, to fill and hand to `host_tensor`."""
    out = array.array(_TYPECODES[dtype])
    assert out.itemsize == dtype.itemsize, (dtype, out.itemsize)
    return out


def host_tensor(values: Sequence[int] | array.array[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host tensor of ``values`` (a list or an `int_array`), sharing an array's memory (kept alive by the tensor)."""
    code = _TYPECODES[dtype]
    flat = values if isinstance(values, array.array) and values.typecode == code else array.array(code, values)
    if not flat:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(flat, dtype=dtype)


def aligned_split(packed: torch.Tensor, parts: Sequence[Sequence[int]], per_16_bytes: int) -> list[torch.Tensor]:
    """The views of ``packed`` (from `aligned_pack`) holding each part, padding left out."""
    sizes = [len(p) + (-len(p) % per_16_bytes) for p in parts]
    return [chunk[: len(p)] for chunk, p in zip(packed.split(sizes), parts, strict=True)]
