"""Where a loaded server's time goes, from the records of a run with ``GLIMPSE_STEP_TRACE=DIR``.

    GLIMPSE_STEP_TRACE=/tmp/trace glimpse serve ...   # then drive it, e.g. with `glimpse bench serving`
    python -m benchmarks.tools.step_trace /tmp/trace

The window runs from the first request reaching the frontend to the end of the last model step. Inside it,
rank 0's model steps are split into set-up, ViT, host preparation, LM forward (eager or CUDA graph) and
sampling; what is left is time the GPU worker sat waiting for a plan (scheduler work and transport). Steps
are classed by what they held: ``decode`` (one token per sequence), ``mixed`` (decodes and a prefill
chunk), ``prefill`` (chunks only), ``vit-only`` (images encoded, nothing to forward).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.args import parser

PHASES = ("setup", "vit", "prep", "forward", "graph", "sample")


def load(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Records by role (frontend, scheduler0, worker0, ...), each list in file order."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(folder.glob("*.jsonl")):
        role = path.stem.rsplit("-", 1)[0]
        out[role] += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def step_class(step: dict[str, Any]) -> str:
    if step["seqs"] == 0:
        return "vit-only"
    if step["decodes"] == step["seqs"]:
        return "decode"
    return "mixed" if step["decodes"] else "prefill"


def row(name: str, seconds: float, window: float, count: int | None = None, note: str = "") -> str:
    per = f"{seconds / count * 1e3:.2f}" if count else ""
    return f"| {name} | {seconds:.3f} | {100 * seconds / window:.1f}% | {count if count is not None else ''} | {per} | {note} |"


def report(records: dict[str, list[dict[str, Any]]], since: float = 0.0) -> str:
    submits = [r for r in records.get("frontend", []) if r["kind"] == "submit" and r["t"] >= since]
    steps = [r for r in records.get("worker0", []) if r["kind"] == "step" and r["start"] >= since]
    sched = [r for role, rs in records.items() if role.startswith("scheduler") for r in rs if r["t"] >= since]
    if not steps:
        return "no model steps recorded"
    t0 = min([s["t"] for s in submits] + [steps[0]["start"]])
    t1 = max(s["end"] for s in steps)
    window = t1 - t0
    lines = [
        f"window {window:.3f} s: {len(submits)} requests, {len(steps)} model steps",
        "",
        "| where | seconds | of window | count | ms each | note |",
        "|---|---|---|---|---|---|",
    ]
    busy = sum(s["end"] - s["start"] for s in steps)
    first_step = steps[0]["start"] - t0
    lines.append(row("before the first step", first_step, window, note="HTTP + tokenizer of the first request(s)"))
    lines.append(row("worker waiting for a plan", window - busy - first_step, window, len(steps), "scheduler + ZMQ"))
    by_class: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in steps:
        by_class[step_class(s)].append(s)
    for cls in ("vit-only", "prefill", "mixed", "decode"):
        group = by_class.get(cls, [])
        if not group:
            continue
        total = sum(s["end"] - s["start"] for s in group)
        tokens = sum(s["tokens"] for s in group)
        decodes = sum(s["decodes"] for s in group)
        spans = sorted(s["end"] - s["start"] for s in group)
        pct = "/".join(f"{1e3 * spans[min(len(spans) - 1, int(q * len(spans)))]:.1f}" for q in (0.5, 0.9, 1.0))
        note = f"{tokens} tokens ({decodes} decodes); p50/p90/max {pct} ms"
        lines.append(row(f"{cls} steps", total, window, len(group), note))
        for phase in PHASES:
            spent = sum(s.get(phase, 0.0) for s in group)
            if spent > 0:
                lines.append(row(f"  {cls}: {phase}", spent, window, len(group)))
    captures = steps[-1].get("graph_captures", 0) - (steps[0].get("graph_captures", 0) if len(steps) > 1 else 0)
    if captures:
        lines.append(f"| CUDA-graph captures during the window | | | {captures} | | inside decode steps |")
    plans = [r for r in sched if r["kind"] == "plan"]
    results = [r for r in sched if r["kind"] == "result"]
    lines.append(row("scheduler: planning", sum(r["t"] - r["start"] for r in plans), window, len(plans)))
    lines.append(row("scheduler: handling results", sum(r["t"] - r["start"] for r in results), window, len(results)))
    arrive = {r["rid"]: r["t"] for r in sched if r["kind"] == "arrive"}
    waits = [arrive[s["rid"]] - s["t"] for s in submits if s["rid"] in arrive]
    if waits:
        waits.sort()
        last = max(arrive.values()) - t0
        lines += [
            "",
            f"frontend -> scheduler (HTTP body, tokenizer, shm): mean {1e3 * sum(waits) / len(waits):.0f} ms, "
            f"median {1e3 * waits[len(waits) // 2]:.0f} ms, max {1e3 * waits[-1]:.0f} ms; "
            f"last request reached the scheduler {last:.2f} s into the window",
        ]
    lines += decode_gaps(steps)
    lines += delivery(records, since)
    return "\n".join(lines)


def decode_gaps(steps: list[dict[str, Any]]) -> list[str]:
    """The inter-token gaps the model steps alone allow: each step's decode rows got their token that long after the
    previous step ended (one gap per decode row), whatever the frontend and the client add after it."""
    gaps = []
    for prev, step in zip(steps, steps[1:]):
        gaps += [step["end"] - prev["end"]] * step["decodes"]
    return ["", f"token gaps of decode rows, model steps only: {_spread(gaps)}"] if gaps else []


def _spread(values: list[float], noun: str = "gaps") -> str:
    values = sorted(values)
    at = [values[min(len(values) - 1, int(q * len(values)))] for q in (0.5, 0.9, 0.99)] + [values[-1]]
    return "p50/p90/p99/max " + "/".join(f"{1e3 * v:.0f}" for v in at) + f" ms over {len(values)} {noun}"


def delivery(records: dict[str, list[dict[str, Any]]], since: float = 0.0) -> list[str]:
    """The token gaps of each stream as the frontend sent them and as the client received them (a client run with
    the same GLIMPSE_STEP_TRACE writes its side): a long gap seen only by the client is the client's (or the socket's),
    one the frontend sees too comes from the scheduler or the steps."""
    sent: dict[str, list[float]] = defaultdict(list)
    for r in records.get("frontend", []):
        if r["kind"] == "sent" and r["t"] >= since:
            sent[r["rid"]].append(r["t"])
    got = {r["rid"]: [t for t in r["times"] if t >= since] for r in records.get("client", []) if r["kind"] == "chunks"}
    lines = []
    for name, by_rid in (("frontend sends", sent), ("client receives", got)):
        gaps = [b - a for times in by_rid.values() for a, b in zip(times, times[1:])]
        if gaps:
            lines.append(f"token gaps, {name}: {_spread(gaps)}")
    lags = []  # each client chunk: how long after the frontend's latest send for that stream
    for rid, times in got.items():
        sends, k = sent.get(rid, []), 0
        for t in times:
            while k < len(sends) and sends[k] <= t:
                k += 1
            if k:
                lags.append(t - sends[k - 1])
    if lags:
        lines.append(f"frontend send -> client receive: {_spread(lags, 'chunks')}")
    return ["", *lines] if lines else []


def per_request(records: dict[str, list[dict[str, Any]]]) -> str:
    """One row per request of a run that sends them one at a time (e.g. `bench multiturn`): the tokenizer's
    share (frontend -> scheduler), the wait for the first step, and the non-decode steps until the next request
    by phase. Overlapping requests would be counted twice: use `report` for a loaded run."""
    submits = sorted((r for r in records.get("frontend", []) if r["kind"] == "submit"), key=lambda r: r["t"])
    steps = [r for r in records.get("worker0", []) if r["kind"] == "step"]
    arrive = {r["rid"]: r["t"] for rs in records.values() for r in rs if r["kind"] == "arrive"}
    # The tokenizer's own records (when it traced): when it got the body, finished admitting (parse, data URLs)
    # and preparing (hashes, the first image, the prompt), by request.
    tok: dict[str, dict[str, float]] = defaultdict(dict)
    landed: dict[str, list[list[float]]] = {}  # a request's deferred images: [start, processed, written] each
    for role, rs in records.items():
        if role.startswith("tokenizer"):
            for r in rs:
                tok[r["rid"]][r["kind"]] = r["t"]
                if r["kind"] == "prepared":  # ImagePrep's marks inside the preparation
                    tok[r["rid"]].update({k: r[k] for k in ("hashed", "processed", "written") if k in r})
                if r["kind"] == "landed":
                    landed[r["rid"]] = r["marks"]
    # The scheduler's MediaReady per request: its last deferred images published
    media = {r["rid"]: r["t"] for r in records.get("scheduler0", []) if r["kind"] == "media"}
    lines = [
        "| request | tokenizer ms | body read; to it, admit, prepare, to scheduler (prepare: hash, images, write, rest) | "
        "deferred images: prepared -> scheduler ms (last image: processed, written after prepared) | "
        "to first step ms | prefill steps | prefill ms | " + " | ".join(PHASES) + " |",
        "|---" * (7 + len(PHASES)) + "|",
    ]
    for i, sub in enumerate(submits):
        end = submits[i + 1]["t"] if i + 1 < len(submits) else float("inf")
        at = arrive.get(sub["rid"])
        mine = [s for s in steps if sub["t"] <= s["start"] < end and step_class(s) != "decode"]
        if at is None or not mine:
            continue
        phases = " | ".join(f"{1e3 * sum(s.get(p, 0.0) for s in mine):.1f}" for p in PHASES)
        span = 1e3 * (mine[-1]["end"] - mine[0]["start"])
        marks = [sub["t"], *(tok[sub["rid"]].get(k) for k in ("recv", "admitted", "prepared")), at]
        split = ", ".join(f"{1e3 * (b - a):.1f}" for a, b in zip(marks, marks[1:])) if None not in marks else ""
        if sub.get("read"):
            split = f"{1e3 * (sub['t'] - sub['read']):.1f}; {split}"
        keys = ("admitted", "hashed", "processed", "written", "prepared")
        if all(k in tok[sub["rid"]] for k in keys):  # the preparation: hashes, images not deferred, prompt + write, rest
            inner = [tok[sub["rid"]][k] for k in keys]
            split += " (" + ", ".join(f"{1e3 * (b - a):.1f}" for a, b in zip(inner, inner[1:])) + ")"
        deferred = ""
        prepared = tok[sub["rid"]].get("prepared")
        if prepared is not None and sub["rid"] in media:
            deferred = f"{1e3 * (media[sub['rid']] - prepared):.1f}"
            if jobs := landed.get(sub["rid"]):
                last = max(jobs, key=lambda m: m[-1])
                deferred += f" ({1e3 * (last[1] - prepared):.1f}, {1e3 * (last[2] - prepared):.1f})"
        lines.append(
            f"| {i} | {1e3 * (at - sub['t']):.1f} | {split} | {deferred} | {1e3 * (mine[0]['start'] - at):.1f} | "
            f"{len(mine)} | {span:.1f} | {phases} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--since", type=float, default=0.0, help="ignore records before this monotonic time")
    ap.add_argument("--requests", action="store_true", help="one row per request (requests sent one at a time)")
    args = ap.parse_args()
    records = load(args.folder)
    print(per_request(records) if args.requests else report(records, args.since))


if __name__ == "__main__":
    main()
