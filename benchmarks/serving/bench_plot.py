"""The offline half of `glimpse bench`: synthetic inputs, statistics, tables, result files and plots.

No network here: everything is a pure function of a seed or of the records a run collected, so the
inputs and the numbers can be unit-tested without a server (bench_client.py holds the HTTP side).
matplotlib is imported only inside the plot functions: it is the slowest import of the tool and only
the very end of a run needs it.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

PlotFn = Callable[[dict[str, Any], Path], None]


RESOLUTIONS = {"720p": (1280, 720), "1080p": (1920, 1080), "2k": (2560, 1440)}
MIME = {"jpeg": "image/jpeg", "png": "image/png"}
# Plain words for filler text: roughly one token each on common tokenizers, so --input-len ~ tokens.
WORDS = ("the image shows a small red house near river with trees under blue sky people walk along road "
         "while birds fly over green hills and clouds move slowly across bright morning light").split()


# ---- images --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resolution:
    """Image size range: fixed when min == max, else width and height are drawn uniformly."""

    min_wh: tuple[int, int]
    max_wh: tuple[int, int]

    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        (w0, h0), (w1, h1) = self.min_wh, self.max_wh
        return int(rng.integers(w0, w1 + 1)), int(rng.integers(h0, h1 + 1))


def parse_resolution(spec: str) -> Resolution:
    """`720p` / `1080p` / `2k`, a fixed `WxH`, or a range `random:WxH-WxH`."""

    def size(text: str) -> tuple[int, int]:
        w, sep, h = text.lower().partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
            raise ValueError(f"bad image size {text!r} in resolution {spec!r} (want WxH)")
        return int(w), int(h)

    key = spec.strip().lower()
    if key in RESOLUTIONS:
        return Resolution(RESOLUTIONS[key], RESOLUTIONS[key])
    if key.startswith("random:"):
        lo, sep, hi = key.removeprefix("random:").partition("-")
        if not sep:
            raise ValueError(f"bad resolution {spec!r}: want random:WxH-WxH")
        (w0, h0), (w1, h1) = size(lo), size(hi)
        return Resolution((min(w0, w1), min(h0, h1)), (max(w0, w1), max(h0, h1)))
    return Resolution(size(key), size(key))


def make_image(width: int, height: int, seed: int | Sequence[int]) -> np.ndarray:
    """A deterministic RGB picture: colour gradient + random rectangles + pixel noise.

    Pure noise would be unrealistically incompressible (JPEGs several times larger than photos'),
    flat colour unrealistically small; the mix gives photo-like encoded sizes.
    """
    rng = np.random.default_rng(seed)
    ys = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    xs = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    a, b, c = (rng.uniform(-128, 128, 3).astype(np.float32) for _ in range(3))
    img = np.empty((height, width, 3), dtype=np.float32)
    img[...] = 128.0 + a * xs + b * ys + c * xs * ys
    for _ in range(int(rng.integers(4, 12))):
        x0, x1 = np.sort(rng.integers(0, width + 1, 2))
        y0, y1 = np.sort(rng.integers(0, height + 1, 2))
        img[y0:y1, x0:x1] = rng.uniform(0, 255, 3)
    # float32 normal draws: float64 ones (numpy's default) take 3x as long at 2K sizes.
    img += rng.standard_normal(img.shape, dtype=np.float32) * np.float32(10.0)
    return np.clip(img, 0, 255).astype(np.uint8)


def encode_image(pixels: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    if fmt == "jpeg":
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    else:
        Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def image_data_url(width: int, height: int, seed: int | Sequence[int], fmt: str) -> str:
    raw = encode_image(make_image(width, height, seed), fmt)
    return f"data:{MIME[fmt]};base64,{base64.b64encode(raw).decode()}"


def random_text(rng: np.random.Generator, words: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), max(1, words)))


def user_message(urls: Sequence[str], text: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": text})
    return {"role": "user", "content": parts}


def chat_body(args: argparse.Namespace, model: str, messages: list[dict[str, Any]]) -> bytes:
    body: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": args.output_len, "temperature": args.temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:  # a vLLM-style extension: only sent when asked, strict servers reject unknown keys
        body["ignore_eos"] = True
    if getattr(args, "logprobs", False):
        body["logprobs"] = True
    return json.dumps(body).encode()


def stats_url(base_url: str) -> str:
    """glimpse serves /admin/stats next to /v1, not under it."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1") + "/admin/stats"


def result_header(args: argparse.Namespace, mode: str, model: str) -> dict[str, Any]:
    """The head of every result file: mode, time, server, model and the flags (API key left out)."""
    config = {k: v for k, v in vars(args).items() if k not in ("handler", "runner", "api_key")}
    config["out"] = str(config["out"])
    if isinstance(config.get("request_rate"), float) and math.isinf(config["request_rate"]):
        config["request_rate"] = "inf"  # JSON has no infinity
    return {"mode": mode, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "base_url": args.base_url,
            "model": model, "config": config}


# ---- statistics ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks; None when empty.

    Same definition as numpy's default ("linear"), so figures agree with whatever the reader
    recomputes from the per-request records in the JSON.
    """
    if not values:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def describe_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean / median / p90 / p99 / max in milliseconds of durations given in seconds (None when empty)."""
    ms = [v * 1000.0 for v in values_s]

    def rounded(v: float | None) -> float | None:
        return None if v is None else round(v, 3)

    return {
        "mean": rounded(sum(ms) / len(ms)) if ms else None,
        "median": rounded(percentile(ms, 50)),
        "p90": rounded(percentile(ms, 90)),
        "p99": rounded(percentile(ms, 99)),
        "max": rounded(max(ms)) if ms else None,
    }


def tpot_s(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first; undefined (None) for answers of one token or fewer."""
    if output_tokens <= 1:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def summarize_serving(records: Sequence[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """Throughput and latency summary of a serving run from its per-request records (JSON form, ms)."""
    ok = [r for r in records if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    per_s = (lambda n: round(n / duration_s, 3)) if duration_s > 0 else (lambda n: 0.0)

    def seconds(key: str) -> list[float]:
        return [r[key] / 1000.0 for r in ok if r[key] is not None]

    itl = [gap / 1000.0 for r in ok for gap in r["itl_ms"]]
    return {
        "duration_s": round(duration_s, 3),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        # Prompt tokens come from usage; a server that sends none makes this equal output throughput.
        "total_token_throughput": per_s(out_tokens + prompt_tokens),
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": prompt_tokens,
        "ttft_ms": describe_ms(seconds("ttft_ms")),
        "tpot_ms": describe_ms(seconds("tpot_ms")),
        "itl_ms": describe_ms(itl),
        "e2e_ms": describe_ms(seconds("e2e_ms")),
        "errors": dict(Counter(r["error"] for r in records if not r["ok"])),
    }


def stats_delta(before: dict[str, Any] | None, after: dict[str, Any] | None, *keys: str) -> int | None:
    def get(stats: dict[str, Any] | None) -> Any:
        for key in keys:
            stats = stats.get(key) if isinstance(stats, dict) else None
        return stats

    """after[keys] - before[keys] of two /admin/stats snapshots; None when either lacks the key."""
    a, b = get(before), get(after)
    return int(b) - int(a) if isinstance(a, int | float) and isinstance(b, int | float) else None


def _gc_rows(stats: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """{process: its garbage-collection row} of one /admin/stats snapshot (the frontend's, the scheduler's and model
    rank 0's)."""
    if not stats:
        return {}
    workers = stats.get("model_workers") or [{}]
    rows = {"frontend": stats.get("frontend_gc"), "scheduler": stats.get("scheduler_gc"),
            "model rank 0": workers[0].get("gc")}
    return {name: row for name, row in rows.items() if isinstance(row, dict)}


def gc_during(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The server's garbage collections during a run, from two /admin/stats snapshots (none without them): per
    process, the full collections on the serving path, all collections' summed pause, and the full ones run idle.
    A process without a row before (a model worker reports with its first step) counts from zero."""
    if before is None:
        return []
    b, a = _gc_rows(before), _gc_rows(after)
    fields = ("full_collections", "pause_ms_sum", "idle_full_collections")
    return [{"process": name, **{f: round(row.get(f, 0) - b.get(name, {}).get(f, 0), 3) for f in fields}}
            for name, row in a.items()]  # fmt: skip


def probe_counts(max_images: int, step: int) -> list[int]:
    """1, then every multiple of step up to max_images (1..N for step 1)."""
    return sorted({1, *range(step, max_images + 1, step)} & set(range(1, max_images + 1)))


# ---- tables --------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}"
    return str(v)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table (first column left-aligned, numbers right-aligned)."""
    cells = [list(header)] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        first = row[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(row[1:], widths[1:]))])

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *(line(r) for r in cells[1:])])


def serving_table(result: dict[str, Any]) -> str:
    s = result["summary"]
    head = [
        ("model", result["model"]),
        ("successful requests", s["completed"]),
        ("failed requests", s["failed"]),
        ("duration (s)", s["duration_s"]),
        ("request throughput (req/s)", s["request_throughput"]),
        ("output token throughput (tok/s)", s["output_throughput"]),
        ("total token throughput (tok/s)", s["total_token_throughput"]),
    ]
    lat = [(name, *(s[key][k] for k in ("mean", "median", "p99", "max")))
           for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))]
    parts = [table(("serving", "value"), head), table(("latency (ms)", "mean", "median", "p99", "max"), lat)]
    if gc := result.get("server_gc"):
        rows = [(g["process"], g["full_collections"], g["pause_ms_sum"], g["idle_full_collections"]) for g in gc]
        parts.append(table(("garbage collections", "full, serving", "all pauses ms", "full, idle"), rows))
    parts += [f"error x{n}: {msg}" for msg, n in s["errors"].items()]
    return "\n\n".join(parts)


def multiturn_table(result: dict[str, Any]) -> str:
    rows = [(r["round"], r["num_images"], r["ttft_ms"], r["e2e_ms"], r["prompt_tokens"], r["output_tokens"],
             r["images_encoded"], r["error"] or "ok") for r in result["rounds"]]
    header = ("round", "images", "TTFT ms", "E2E ms", "prompt tok", "output tok", "encoded", "status")
    return table(header, rows)


def probe_table(result: dict[str, Any]) -> str:
    rows = [(r["num_images"], r["ttft_ms"], r["e2e_ms"], r["prompt_tokens"],
             None if r["peak_gpu_bytes"] is None else r["peak_gpu_bytes"] / 2**30, r["error"] or "ok")
            for r in result["probes"]]
    return table(("images", "TTFT ms", "E2E ms", "prompt tok", "peak GPU GiB", "status"), rows)


# ---- files ---------------------------------------------------------------------------------------


def result_paths(out_dir: Path, mode: str) -> tuple[Path, Path]:
    """`<out>/<mode>-<timestamp>.json` and `.png`; a numeric suffix keeps two runs in one second apart."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = stem, 0
    while (out_dir / f"{candidate}.json").exists() or (out_dir / f"{candidate}.png").exists():
        n += 1
        candidate = f"{stem}-{n}"
    return out_dir / f"{candidate}.json", out_dir / f"{candidate}.png"


def write_result(result: dict[str, Any], out_dir: Path, plot: PlotFn) -> dict[str, Any]:
    """Write the JSON and the PNG for `result` (whose "mode" names the files); record their paths in it."""
    json_path, png_path = result_paths(out_dir, result["mode"])
    result["files"] = {"json": str(json_path), "png": str(png_path)}
    try:
        plot(result, png_path)
    except ImportError:  # a GPU box without matplotlib still gets the numbers
        result["files"]["png"] = None
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result
