"""How long a model worker takes to fill its model from a checkpoint on disk (``load_model``), variants alternating in
one process.

    python -m benchmarks.engine.load_bench CHECKPOINT [--rounds 2] [--variants "as served,strided on host"]
    python -m benchmarks.engine.load_bench --demo qwen3_vl_moe    # a tiny demo checkpoint written for the run

``as served``: today's loader. ``strided on host``: fused expert stacks copied from their host tensors as strided
views (their transposes and slices run on the host), as before ``qwen3_vl/moe.py``'s ``whole_on_device``. ``ahead``:
a thread moves each checkpoint tensor to the GPU one tensor ahead of the loaders (``load.on_device_ahead``,
``GLIMPSE_LOAD_AHEAD=1``). Each
round builds the model afresh (TP=1, bf16, the vision tower included) and times the load to a synchronised GPU; the
checkpoint's pages are in the host's page cache after the first round, so the first round is reported apart. Prints
one table row per variant and round: seconds, GB of tensors read, GB/s.
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from benchmarks.args import parser
from workers.engine.layers.linear import TPGroup
from workers.engine.models import family as family_package, load, load_spec
from workers.engine.models.demo_writer import write_demo_model
from workers.engine.models.load import load_model
from workers.engine.models.loader import check_checkpoint
from workers.engine.models.qwen3_vl import moe


@contextmanager
def strided_on_host() -> Iterator[None]:
    kept: Callable[..., torch.Tensor] = moe.whole_on_device
    moe.whole_on_device = lambda loaded, param, tp_size: loaded
    try:
        yield
    finally:
        moe.whole_on_device = kept


@contextmanager
def ahead() -> Iterator[None]:
    kept = load.LOAD_AHEAD
    load.LOAD_AHEAD = True
    try:
        yield
    finally:
        load.LOAD_AHEAD = kept


VARIANTS: dict[str, Callable[[], AbstractContextManager[None]]] = {
    "as served": nullcontext, "strided on host": strided_on_host, "ahead": ahead}


def one_load(checkpoint: str, variant: str) -> float:
    spec = load_spec(checkpoint)
    device = torch.device("cuda")
    built = family_package(spec.family).build(spec, TPGroup(), torch.bfloat16, device, "sdpa")
    torch.cuda.synchronize()
    started = time.perf_counter()
    with VARIANTS[variant]():
        load_model(built, checkpoint)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del built
    gc.collect()
    torch.cuda.empty_cache()
    return seconds


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("checkpoint", nargs="?", help="a checkpoint directory (or --demo)")
    ap.add_argument("--demo", metavar="FAMILY", help="write FAMILY's tiny demo checkpoint and load that")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="as served,strided on host,ahead")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
    if (args.checkpoint is None) == (args.demo is None):
        raise SystemExit("name a checkpoint directory or --demo FAMILY")
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = args.checkpoint or str(write_demo_model(scratch, args.demo))
        table(checkpoint, variants, args.rounds)


def table(checkpoint: str, variants: list[str], rounds: int) -> None:
    gb = check_checkpoint(checkpoint) / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {checkpoint}: {gb:.2f} GB of tensors")
    print("| round | variant | load, s | GB/s |")
    print("|---|---|---|---|")
    for r in range(rounds):
        for variant in variants:
            seconds = one_load(checkpoint, variant)
            print(f"| {r + 1} | {variant} | {seconds:.1f} | {gb / seconds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
