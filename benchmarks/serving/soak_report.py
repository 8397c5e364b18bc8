"""The soak's output: a table row per process at fixed marks while it runs, then the verdict, the JSON and a PNG
of memory over time (one line per process, plus /dev/shm and the embedding cache)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def mark_every(seconds: float) -> float:
    """Print interval: every 10 s for a short run, every minute up to half an hour, then every 5 minutes."""
    if seconds < 300:
        return 10.0
    return 60.0 if seconds < 1800 else 300.0


def table(row: dict[str, Any], requests: int, failures: int, disconnects: int) -> str:
    """One mark: a line per process (RSS, anon RSS, fds, threads) and a line of shared state."""
    lines = [f"-- t={row['t']:7.1f}s  requests {requests}  failures {failures}  disconnects {disconnects}"]
    for role, p in sorted(row["procs"].items()):
        lines.append(f"   {role:14s} pid {int(p['pid']):7d}  rss {p['rss_mib']:8.1f} MiB  anon {p['anon_mib']:8.1f} MiB"
                     f"  fds {int(p['fds']):4d}  threads {int(p['threads']):3d}")
    s = row["stats"]
    lines.append(f"   /dev/shm {row['dev_shm_segments']} segments {row['dev_shm_bytes'] / 2**20:.1f} MiB;"
                 f" stats: shm {s.get('shm_bytes', 0) / 2**20:.1f} MiB in {s.get('shm_segments', 0)},"
                 f" mm_cache {s.get('mm_cache_bytes', 0) / 2**20:.1f} MiB in {s.get('mm_cache_entries', 0)},"
                 f" in flight {s.get('in_flight', 0)}")
    return "\n".join(lines)


def verdict_lines(verdict: dict[str, dict[str, Any]]) -> str:
    lines = ["plateau (RSS over the last half after warm-up):"]
    for role, v in verdict.items():
        lines.append(f"   {role:14s} {v['rss_half_start_mib']:8.1f} -> {v['rss_end_mib']:8.1f} MiB"
                     f"  {v['growth_mib']:+7.1f} MiB ({v['growth_pct']:+.2f} %)  fds {v['fds']}  threads {v['threads']}"
                     f"  {'flat' if v['flat'] else 'GROWING'}")
    return "\n".join(lines)


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def plot(path: Path, samples: list[dict[str, Any]], warmup_s: float, title: str) -> None:
    """RSS per process (left axis) and /dev/shm + embedding-cache bytes (right axis) over time."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 6))
    t = [s["t"] / 60 for s in samples]
    roles = sorted({r for s in samples for r in s["procs"]})
    for role in roles:
        ax.plot(t, [s["procs"].get(role, {}).get("rss_mib", float("nan")) for s in samples], label=f"{role} RSS")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.axvline(warmup_s / 60, color="grey", linestyle=":", label="end of warm-up")
    right = ax.twinx()
    right.plot(t, [s["dev_shm_bytes"] / 2**20 for s in samples], "k--", label="/dev/shm of the launch")
    right.plot(t, [s["stats"].get("mm_cache_bytes", 0) / 2**20 for s in samples], "k:", label="embedding cache")
    right.set_ylabel("MiB (dashed: /dev/shm, dotted: embedding cache)")
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
