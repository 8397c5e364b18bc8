"""The figures `glimpse bench` writes beside its JSON: TTFT/E2E distributions of a serving run, per-round TTFT of
a multi-turn run, and TTFT against images per request of a probe.

matplotlib is imported only inside these functions: it is the slowest import of the tool and only the very end of
a run needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers, and no GUI toolkit to import
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_serving(result: dict[str, Any], path: Path) -> None:
    """Histogram (top) and CDF (bottom) of TTFT and E2E over the successful requests."""
    plt = _pyplot()
    ok = [r for r in result["requests"] if r["ok"]]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for col, (key, name) in enumerate((("ttft_ms", "TTFT"), ("e2e_ms", "E2E latency"))):
        values = sorted(r[key] for r in ok if r[key] is not None)
        hist, cdf = axes[0][col], axes[1][col]
        if values:
            hist.hist(values, bins=min(50, max(5, len(values) // 2)), color="tab:blue", alpha=0.8)
            cdf.plot(values, [(i + 1) / len(values) for i in range(len(values))], drawstyle="steps-post")
        hist.set(title=f"{name} histogram", xlabel="ms", ylabel="requests")
        cdf.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        cdf.grid(alpha=0.3)
    s = result["summary"]
    fig.suptitle(f"{result['model']}: {s['completed']} ok, {s['failed']} failed, "
                 f"{s['request_throughput']} req/s, {s['output_throughput']} tok/s")
    _save(plt, fig, path)


def _counts_axis(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.set_ylim(bottom=0)  # latency from zero: a 2 ms wobble must not look like a cliff
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds and image counts are whole
    ax.grid(alpha=0.3)


def _ttft_figure(xs: list[Any], ys: list[Any], xlabel: str, ylabel: str, title: str) -> tuple[Any, Any, Any]:
    """(pyplot, figure, axes) with TTFT as a line over a whole-number count; the caller adds its second series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(xs, ys, marker="o", color="tab:blue")
    _counts_axis(ax, xlabel, ylabel, title)
    return plt, fig, ax


def _on_top(ax: Any, twin: Any) -> None:
    # twinx axes draw over the original; lift the line axis so bars stay behind it.
    ax.set_zorder(twin.get_zorder() + 1)
    ax.patch.set_visible(False)


def plot_multiturn(result: dict[str, Any], path: Path) -> None:
    """TTFT per round (line), with images encoded per round (bars) when the server reports them."""
    rounds = [r for r in result["rounds"] if r["ok"]]
    plt, fig, ax = _ttft_figure([r["round"] for r in rounds], [r["ttft_ms"] for r in rounds],
                                "round (= images in the request)", "TTFT ms (line)",
                                f"{result['model']}: one chat, one new image per round")
    encoded = [(r["round"], r["images_encoded"]) for r in rounds if r["images_encoded"] is not None]
    if encoded:
        twin = ax.twinx()
        bars = twin.bar([x for x, _ in encoded], [y for _, y in encoded], alpha=0.3, color="tab:orange")
        twin.bar_label(bars)
        twin.set_ylabel("images encoded by the server (bars)")
        twin.set_ylim(0, max(2, max(y for _, y in encoded)) * 1.2)
        _on_top(ax, twin)
    _save(plt, fig, path)


def plot_probe(result: dict[str, Any], path: Path) -> None:
    """TTFT and (when reported) peak GPU memory against images per request."""
    probes = [p for p in result["probes"] if p["ok"]]
    plt, fig, ax = _ttft_figure([p["num_images"] for p in probes], [p["ttft_ms"] for p in probes],
                                "images per request", "TTFT ms (blue)",
                                f"{result['model']}: images per request at {result['config']['resolution']}")
    memory = [(p["num_images"], p["peak_gpu_bytes"] / 2**30) for p in probes if p["peak_gpu_bytes"] is not None]
    if memory:
        twin = ax.twinx()
        twin.plot([x for x, _ in memory], [y for _, y in memory], marker="s", color="tab:red")
        twin.set_ylabel("peak GPU memory GiB (red)")
        twin.set_ylim(bottom=0)
    failure = result.get("first_failure")
    if failure:
        ax.axvline(failure["num_images"], color="gray", linestyle="--", label=f"failed at {failure['num_images']}")
        ax.legend(loc="lower right")
    _save(plt, fig, path)
