"""flash-linear-attention's kernel configs to ship (workers/engine/kernels/fla_tuning.py): each per-rank shape of a
linear-attention layer autotuned on this card as a served start calls fla, the choices written in fla's config-file
format, and a table of what each shape's autotunes cost.

    python -m benchmarks.kernels.fla_configs --dest workers/engine/kernels/fla_configs/sm90 [--heads 16:32,8:16]
        [--tokens 4096 --seqs 2]

Shapes (``--heads`` key:value heads per rank, head dims ``--head-dim``): by default those of the hybrid shapes in
benchmarks/checkpoints.py at tensor-parallel sizes 1, 2, 4 and 8. fla keys its autotunes by shape and dtypes only,
so whichever call comes first picks the config for every later length: here that is a served prefill chunk's size
(``--tokens`` in ``--seqs`` sequences), where a served start's own autotunes time a warm-up call of a few tokens.
The autotunes run with fla's config lookup off (every candidate compiled and timed, as on a new host without shipped
files), so the table is the cold start each shape's files save. A served start writes the same keys with ``GLIMPSE_FLA_CONFIG_DUMP=DIR`` (timed on its warm-up's
calls); the files merge, the last write of a key winning.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from benchmarks.args import parser
from benchmarks.checkpoints import HYBRID, SHAPES
from workers.engine.kernels.gated_delta_fla import TUNE_TOKENS

TP_SIZES = (1, 2, 4, 8)


def default_heads() -> list[tuple[int, int]]:
    """(key heads, value heads) per rank of every hybrid shape at each TP size that divides both."""
    found: set[tuple[int, int]] = set()
    for family, fields, _ in SHAPES.values():
        if family in HYBRID:
            hk, hv = fields["linear_num_key_heads"], fields["linear_num_value_heads"]
            found |= {(hk // tp, hv // tp) for tp in TP_SIZES if hk % tp == 0 and hv % tp == 0}
    return sorted(found, reverse=True)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--dest", type=Path, required=True, help="the folder the config files are written to (merged)")
    ap.add_argument("--heads", default="", help="key:value heads per rank, comma-separated (default: see above)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=TUNE_TOKENS, help="the prefill each autotune is timed on (a served chunk)")
    ap.add_argument("--seqs", type=int, default=2, help="sequences the prefill is cut into")
    ap.add_argument("--budget-s", type=float, default=0, help="start no shape after this many seconds (0: no limit)")
    args = ap.parse_args()
    os.environ["FLA_CACHE_MODE"] = "disabled"  # autotune everything here; fla_tuning leaves a user's mode alone
    from workers.engine.kernels import autotune_compiles, fla_tuning, gated_delta_fla

    heads = [tuple(int(n) for n in pair.split(":")) for pair in args.heads.split(",")] if args.heads else default_heads()
    autotune_compiles.install()
    started = time.perf_counter()
    rows = []
    for hk, hv in heads:
        if args.budget_s and time.perf_counter() - started > args.budget_s:
            print(f"budget spent: {hk}:{hv} and later shapes left out")
            break
        before = dict(autotune_compiles.stats)
        t0 = time.perf_counter()
        ok = gated_delta_fla.tune_shape(hk, hv, args.head_dim, args.head_dim, torch.bfloat16, args.tokens, args.seqs)
        torch.cuda.synchronize()
        spent = {k: autotune_compiles.stats[k] - before[k] for k in before}
        rows.append((f"{hk}:{hv}", time.perf_counter() - t0, spent, ok))
    written = fla_tuning.dump(args.dest, fla_tuning.fla_tuners())
    print(f"\n{torch.cuda.get_device_name()}, fla configs: {written} entries written to {args.dest}\n")
    print("| heads (key:value) | seconds | autotunes | candidates | compiling, s | timing, s | probes passed |")
    print("|---|---|---|---|---|---|---|")
    for name, seconds, spent, ok in rows:
        print(f"| {name} | {seconds:.1f} | {spent['tunes']:.0f} | {spent['configs']:.0f} | {spent['compile_s']:.1f} "
              f"| {spent['time_s']:.1f} | {ok} |")


if __name__ == "__main__":
    main()
