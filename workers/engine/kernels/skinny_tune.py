"""Which skinny-GEMM tile, or cuBLAS, serves each of a model's decode projections: measured at start-up.

skinny_gemm.tile's fixed rule and its MIN_WEIGHT_BYTES cut were fitted to a 7B's matrices on an H200, and other
shapes fall off them (H200, one row, `python -m benchmarks.kernels.skinny_gemm_bench`): the Qwen3.5-27B's 16,480-row
in_proj took 23% longer split in two than whole, and a Qwen3-VL-8B's down projection 13% longer on the kernel than
on cuBLAS. So each weight shape a decode step streams is timed once, on the model's own weights (every weight of
that shape in turn, so nothing is read from L2), with cuBLAS, the rule's tile and a few others as candidates; the
fastest at 1 and at 16 rows together serves from then on (skinny_gemm.use_measured), before any CUDA-graph capture.

The choices are kept on disk (``cache_file``) under the card, its multiprocessor count, the dtype, the torch and
Triton versions and skinny_gemm.KERNEL_VERSION: a restarted server takes the same tiles (the same numerics: a
split-K tile sums in another order) without measuring again. ``GLIMPSE_SKINNY_TUNE=0`` keeps the fixed rule.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.engine.kernels import skinny_gemm
from workers.engine.kernels.launch_helpers import worker_thread
from workers.engine.kernels.skinny_gemm import Tile

log = logging.getLogger("glimpse.model")

ENV = "GLIMPSE_SKINNY_TUNE"
CACHE_ENV = "GLIMPSE_SKINNY_TUNE_CACHE"
MIN_BYTES = 16 << 20  # below this a projection is launch-bound and cuBLAS serves it (the kernel never won there)
# A pass over fewer bytes than this would be read partly from L2 (50 MB on an H100 or H200) and look faster than a
# decode step sees it: such a shape (a lone small weight) keeps the fixed rule.
MIN_PASS_BYTES = 128 << 20
ROWS = (1, skinny_gemm.MAX_ROWS)

# (weights of one shape, candidate (None: cuBLAS), rows) -> GPU ms of one pass over the weights
Timer = Callable[[list[Tensor], Tile | None, int], float]


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def candidates(n: int, k: int, sms: int) -> list[Tile | None]:
    """cuBLAS, the fixed rule's tile, whole-K strips of a few widths, and K split in 2, 4 and 8 where it divides
    into whole 128-wide blocks of at least 256 columns."""
    tiles: list[Tile | None] = [None, skinny_gemm.tile(n, k, sms)]
    tiles += [Tile(32, 128, 1, 2, 4), Tile(32, 256, 1, 2, 4), Tile(64, 128, 1, 4, 4), Tile(128, 128, 1, 4, 4)]
    for split in (2, 4, 8):
        if k % (split * 128) == 0 and k // split >= 256:
            tiles += [Tile(32, 128, split, 4, 4), Tile(32, 128, split, 4, 3)]
    return list(dict.fromkeys(tiles))  # the rule's tile may be one of the others


def graph_ms(weights: list[Tensor], pick: Tile | None, rows: int) -> float:
    """GPU ms of one pass of ``rows`` rows over ``weights`` with ``pick``, replayed from a CUDA graph (a decode
    step replays its projections so: launch costs are not the GPU's)."""
    k = weights[0].shape[1]
    x = torch.randn(rows, k, device=weights[0].device, dtype=weights[0].dtype)

    def run() -> None:
        for w in weights:
            if pick is None:
                F.linear(x, w)
            else:
                skinny_gemm.linear(x, w, use=pick)

    reps = max(3, min(20, int(2e9 // sum(w.nbytes for w in weights))))  # ~2 GB streamed
    with torch.cuda.device(x.device):  # the weights' card, whichever is current
        return replay_ms(run, reps)


def replay_ms(fn: Callable[[], None], reps: int, warm: int = 1) -> float:
    """GPU ms per replay of ``fn`` captured in a CUDA graph, after ``warm`` untimed replays; ``fn`` runs once
    first, outside the capture, so that no kernel's first launch (a Triton compile) is captured."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warm):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ms: float = start.elapsed_time(end) / reps
    return ms


def first_launches(runs: list[tuple[Tensor, Tile, int]]) -> None:
    """Each (weight, tile, rows) launched once, on threads: a kernel variant's first launch is its Triton compile
    (0.05-0.8 s, mostly outside the GIL), and with an empty cache the timing loop would otherwise meet the
    candidates' ~10 variants one after another. One launch per variant: shapes that share a tile share its compile."""
    if not runs or not runs[0][0].is_cuda:
        return
    device = runs[0][0].device
    variants = list({(tile, rows): (w, tile, rows) for w, tile, rows in runs}.values())

    def launch(run: tuple[Tensor, Tile, int]) -> None:
        w, tile, rows = run
        with worker_thread(device):
            skinny_gemm.linear(torch.zeros(rows, w.shape[1], device=device, dtype=w.dtype), w, use=tile)

    with ThreadPoolExecutor(min(8, len(variants)), thread_name_prefix="skinny-compile") as pool:
        list(pool.map(launch, variants))
    torch.cuda.synchronize(device)


def tune(weights: Iterable[Tensor], key: str, sms: int, timer: Timer = graph_ms,
         path: Path | None = None, compile_first: Callable[[list[tuple[Tensor, Tile, int]]], None] = first_launches,
         ) -> dict[tuple[int, int], Tile | None]:
    """Choose per weight shape of ``weights`` (at least MIN_BYTES each, MIN_PASS_BYTES per shape) the fastest
    candidate, or the one ``path``'s entry for ``key`` (the card and versions) remembers; register each with
    skinny_gemm and write the new ones back. Returns the choices. The candidates to time are launched once first,
    together (``compile_first``)."""
    path = path or cache_file()
    by_shape: dict[tuple[int, int], list[Tensor]] = {}
    for w in {w.data_ptr(): w for w in weights if w.dim() == 2 and w.nbytes >= MIN_BYTES}.values():
        by_shape.setdefault((w.shape[0], w.shape[1]), []).append(w)
    stored = _read(path)
    known = stored.get(key, {})
    chosen: dict[tuple[int, int], Tile | None] = {}
    started, timed = time.perf_counter(), 0
    measured = {shape: group for shape, group in sorted(by_shape.items())
                if sum(w.nbytes for w in group) >= MIN_PASS_BYTES}
    compile_first([(group[0], c, rows) for (n, k), group in measured.items() if f"{n}x{k}" not in known
                   for c in candidates(n, k, sms) if c is not None for rows in ROWS])
    for (n, k), group in measured.items():
        name = f"{n}x{k}"
        if name in known:
            entry = known[name]
            pick = None if entry is None else Tile(*entry)
        else:
            costs = {c: sum(timer(group, c, rows) for rows in ROWS) for c in candidates(n, k, sms)}
            pick = min(costs, key=lambda c: costs[c])
            timed += 1
            known[name] = None if pick is None else list(pick)
        chosen[(n, k)] = pick
        skinny_gemm.use_measured(n, k, pick)
    if timed:
        stored[key] = known
        _write(path, stored)
        log.info("skinny GEMM: measured %d weight shapes in %.1f s: %s", timed, time.perf_counter() - started,
                 ", ".join(f"{n}x{k} {'cuBLAS' if t is None else tuple(t)}" for (n, k), t in chosen.items()))
    return chosen


def cache_key(device: torch.device, dtype: torch.dtype) -> str:
    import triton

    props = torch.cuda.get_device_properties(device)
    return (f"{props.name}|{props.multi_processor_count} SMs|{dtype}|torch {torch.__version__}|"
            f"triton {triton.__version__}|kernel {skinny_gemm.KERNEL_VERSION}")


def cache_file() -> Path:
    return Path(os.environ.get(CACHE_ENV, "~/.cache/glimpse/skinny-tiles.json")).expanduser()


def _read(path: Path) -> dict[str, dict[str, list[int] | None]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measure again
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict[str, dict[str, list[int] | None]]) -> None:
    """Atomically (tensor-parallel ranks may write at once); a read-only home only costs the next start a measure."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        log.info("skinny GEMM choices not kept (%s): the next start measures again", exc)
