"""What a soak samples: each server process's RSS, open fds and threads (from /proc), the launch's /dev/shm
segments and a few /admin/stats fields; and the plateau verdict drawn from those samples afterwards.

Processes are found by role: the launcher (which also runs the HTTP frontend) is the root, and every child the
launcher spawns carries ``GLIMPSE_ROLE=<role>[<index>]`` in its environment (server/launcher.py).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ipc.shm import SHM_DIR, list_segments

LAUNCHER = "launcher"


def role_of(pid: int) -> str | None:
    """``model[0]``, ``scheduler[0]``, ``tokenizer[1]``... from the process's environment; None if it has none."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in env.split(b"\0"):
        if item.startswith(b"GLIMPSE_ROLE="):
            return item.split(b"=", 1)[1].decode()
    return None


def children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc/<pid>/task/*/children (no pgrep: one fork less per sample)."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            found.extend(int(c) for c in text.split())
    except OSError:
        pass
    return found


def server_processes(root: int) -> dict[str, int]:
    """Role -> pid for the launcher and each child that has a role (the resource tracker has none)."""
    procs = {LAUNCHER: root}
    for pid in children(root):
        role = role_of(pid)
        if role is not None:
            procs[role] = pid
    return procs


def proc_sample(pid: int) -> dict[str, float] | None:
    """RSS (MiB), anonymous RSS (MiB), open fds and threads of one process; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status if ":" in line)

    def kib(name: str) -> float:
        return int(fields.get(name, "0 kB").split()[0]) / 1024

    return {"rss_mib": kib("VmRSS"), "anon_mib": kib("RssAnon"), "fds": fds,
            "threads": int(fields.get("Threads", "0"))}


def shm_usage(launch_id: str | None) -> tuple[int, int]:
    """(segments, bytes) of the launch in /dev/shm, as the file system sees them."""
    if launch_id is None:
        return 0, 0
    names = list_segments(launch_id)
    total = 0
    for name in names:
        try:
            total += os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512  # resident, not just the length
        except OSError:
            continue
    return len(names), total


def stats_fields(base: str, headers: dict[str, str]) -> dict[str, Any]:
    """The /admin/stats fields a soak watches; empty when the server does not answer."""
    try:
        stats = httpx.get(base + "/admin/stats", timeout=5.0, headers=headers).json()
    except (httpx.HTTPError, ValueError):
        return {}
    req, shm, mm = stats.get("requests", {}), stats.get("shm", {}), stats.get("mm_cache", {})
    return {"mm_cache_bytes": mm.get("bytes", 0), "mm_cache_entries": mm.get("entries", 0),
            "shm_bytes": shm.get("bytes", 0), "shm_segments": shm.get("segments", 0),
            "requests_ok": req.get("ok", 0), "requests_failed": req.get("failed", 0),
            "requests_aborted": req.get("aborted", 0), "in_flight": req.get("in_flight_http", 0),
            "kv_blocks_used": stats.get("kv_blocks", {}).get("used", 0)}


@dataclass
class Sampler:
    """One sample of everything, on demand; the soak calls ``take`` at a fixed interval from its own thread."""

    root: int | None
    base: str
    launch_id: str | None
    headers: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    samples: list[dict[str, Any]] = field(default_factory=list)

    def take(self) -> dict[str, Any]:
        procs: dict[str, dict[str, float]] = {}
        if self.root is not None:
            for role, pid in server_processes(self.root).items():
                sample = proc_sample(pid)
                if sample is not None:
                    procs[role] = {"pid": pid, **sample}
        segments, shm_bytes = shm_usage(self.launch_id)
        row = {"t": round(time.monotonic() - self.started, 2), "procs": procs,
               "dev_shm_segments": segments, "dev_shm_bytes": shm_bytes, "stats": stats_fields(self.base, self.headers)}
        self.samples.append(row)
        return row


def _median_at(samples: list[dict[str, Any]], role: str, key: str, start: float, end: float) -> float | None:
    values = [s["procs"][role][key] for s in samples if start <= s["t"] <= end and role in s["procs"]]
    return statistics.median(values) if values else None


def plateau(samples: list[dict[str, Any]], warmup_s: float, flat_mib: float, flat_pct: float,
            window_s: float | None = None) -> dict[str, dict[str, Any]]:
    """Per process: RSS growth over the last half of the run after warm-up, in MiB and %.

    Each end is the median of the samples in a window (a tenth of the half, at least one sample) so one
    sample caught mid-request does not decide the verdict. ``flat``: growth at most ``flat_mib`` or
    ``flat_pct`` % of the RSS at the half's start, whichever is larger. fds and threads are compared the same way."""
    if not samples:
        return {}
    end_t = samples[-1]["t"]
    mid = warmup_s + (end_t - warmup_s) / 2
    window = window_s if window_s is not None else max((end_t - mid) / 10, 1e-9)
    roles = sorted({r for s in samples for r in s["procs"]})
    verdict: dict[str, dict[str, Any]] = {}
    for role in roles:
        first = _median_at(samples, role, "rss_mib", mid, mid + window)
        last = _median_at(samples, role, "rss_mib", end_t - window, end_t)
        if first is None or last is None:
            continue
        growth = last - first
        fds = [_median_at(samples, role, "fds", a, b) for a, b in ((mid, mid + window), (end_t - window, end_t))]
        threads = [_median_at(samples, role, "threads", a, b) for a, b in ((mid, mid + window), (end_t - window, end_t))]
        warm = [s["procs"][role]["rss_mib"] for s in samples if s["t"] >= warmup_s and role in s["procs"]]
        verdict[role] = {
            "rss_half_start_mib": round(first, 1), "rss_end_mib": round(last, 1),
            "growth_mib": round(growth, 1), "growth_pct": round(100 * growth / first, 2) if first else 0.0,
            "rss_max_after_warmup_mib": round(max(warm), 1) if warm else None,
            "rss_min_after_warmup_mib": round(min(warm), 1) if warm else None,
            "fds": fds, "threads": threads,
            "flat": growth <= max(flat_mib, flat_pct / 100 * first),
        }
    return verdict
