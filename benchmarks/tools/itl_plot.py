"""The inter-token gaps of serving runs side by side: a table of their percentiles and a plot of their distribution
(the share of gaps longer than x, log scale, so the tail the percentiles summarise is visible), from the result files
``glimpse bench serving --logprobs`` writes (one gap per token: without ``--logprobs`` a gap spans the tokens that
carried no text).

    python -m benchmarks.tools.itl_plot docs/figures/itl-b.png "FA4=run1/serving-X.json" "FA2=run2/serving-Y.json" \\
        --marks "vLLM 0.24=50:8.55,90:75.6,99:117.6,100:368.2"

``--marks`` adds a run known only by its percentiles (``p:ms`` pairs, 100 being the max) as points on the same axes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.args import parser
from benchmarks.serving.bench_figures import _pyplot, _save
from benchmarks.serving.bench_plot import percentile, table

PERCENTILES = (50.0, 90.0, 99.0, 99.9, 100.0)
LONG_MS = 100.0  # the table counts the gaps over this: a stall a reader of the stream notices


def gaps(result: dict[str, Any]) -> list[float]:
    """Every inter-token gap (ms) of a result file's successful requests, in no particular order."""
    return [g for r in result["requests"] if r["ok"] for g in (r.get("itl_ms") or [])]


def parse_marks(spec: str) -> tuple[str, dict[float, float]]:
    """``"label=p:ms,p:ms"`` as (label, {percentile: ms})."""
    label, _, points = spec.rpartition("=")
    if not label or not points:
        raise SystemExit(f"itl_plot: --marks takes LABEL=P:MS,P:MS..., not {spec!r}")
    marks = {float(p): float(ms) for p, ms in (point.split(":") for point in points.split(","))}
    return label, marks


def rows(series: dict[str, list[float]]) -> list[list[Any]]:
    out = []
    for label, values in series.items():
        cuts = [percentile(values, q) for q in PERCENTILES]
        out.append([label, len(values), *(f"{c:.1f}" if c is not None else "-" for c in cuts),
                    sum(g > LONG_MS for g in values)])
    return out


def plot(series: dict[str, list[float]], marks: dict[str, dict[float, float]], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, values in series.items():
        ordered = sorted(values)
        n = len(ordered)
        ax.plot(ordered, [(n - i) / n for i in range(n)], drawstyle="steps-post", label=f"{label} ({n} gaps)")
    for label, points in marks.items():
        ax.plot(list(points.values()), [max(1 - p / 100, 0.5 / 10_000) for p in points], "D", label=f"{label} (percentiles)")
    ax.set(xlabel="inter-token gap, ms", ylabel="share of gaps longer", yscale="log",
           title="inter-token gaps (one per token)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    _save(plt, fig, path)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("out", type=Path, help="the PNG to write")
    ap.add_argument("runs", nargs="+", help="LABEL=result.json of `glimpse bench serving --logprobs`")
    ap.add_argument("--marks", action="append", default=[], help="LABEL=P:MS,... a run known by its percentiles")
    args = ap.parse_args()
    series: dict[str, list[float]] = {}
    for spec in args.runs:
        label, _, file = spec.rpartition("=")
        if not label:
            raise SystemExit(f"itl_plot: a run is LABEL=FILE, not {spec!r}")
        series[label] = gaps(json.loads(Path(file).read_text()))
    marks = dict(parse_marks(spec) for spec in args.marks)
    header = ["run", "gaps", *(f"p{q:g}" if q < 100 else "max" for q in PERCENTILES), f"> {LONG_MS:g} ms"]
    print(table(header, rows(series)))
    plot(series, marks, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
