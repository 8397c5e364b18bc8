"""`glimpse bench`: a load generator for any OpenAI-compatible chat endpoint (glimpse, vLLM, SGLang).

    glimpse bench serving   --num-prompts 200 --concurrency 32 --resolution 1080p --output-len 128
    glimpse bench multiturn --rounds 8 --resolution 1080p
    glimpse bench probe     --max-images 32 --step 4 --resolution 2k

Every image is generated and encoded locally (seeded, so two servers see the same bytes) in a thread
pool before the clock starts; request bodies are serialized before timing too. Each mode prints a
table and writes `<out>/<mode>-<timestamp>.json` (config, per-request records, summary) and `.png`.

Client choice: raw httpx + our own SSE parsing rather than the async openai client. The openai client
validates every chunk into pydantic models, CPU the load generator then spends on its own event loop,
which shows up as inflated ITL under load; raw lines also let us timestamp bytes as they arrive and
size the connection pool to the concurrency explicitly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.serving import bench_figures as figures, bench_plot as report
from benchmarks.serving.bench_plot import (
    PlotFn,
    Resolution,
    image_data_url,
    parse_resolution,
    probe_counts,
    random_text,
    user_message,
)

# The step trace's folder (workers/common/step_trace.py's variable), read once: set, the client records its side too.
TRACE_DIR = os.environ.get("GLIMPSE_STEP_TRACE", "")

# ---- SSE and one streamed request ----------------------------------------------------------------


class SSEDecoder:
    """Incremental server-sent-events decoder: feed it lines (no newline), get each event's data."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if not line:  # a blank line ends the event
            return self.flush()
        if line.startswith(":"):  # comment / keep-alive
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))  # the spec strips exactly one leading space
        return None  # event:, id:, retry: carry nothing a chat stream needs

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def parse_sse(lines: Iterable[str]) -> list[str]:
    """Every event's data in a recorded stream, a trailing unterminated event included."""
    decoder = SSEDecoder()
    events = [d for d in map(decoder.feed, lines) if d is not None]
    tail = decoder.flush()
    return events + ([tail] if tail is not None else [])


@dataclass
class RequestRecord:
    """What one streamed chat request did; times in seconds since its own send."""

    num_images: int = 0
    start_s: float = 0.0  # since the run's start (arrival pattern)
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    tokens_from_usage: bool = False
    finish_reason: str | None = None
    text: str = ""
    rid: str = ""  # the server's id for it (the chunks' "id")
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each chunk with tokens (step trace)

    def to_json(self) -> dict[str, Any]:
        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1000.0, 3)

        tpot = None
        if self.e2e_s is not None and self.ttft_s is not None:
            tpot = report.tpot_s(self.e2e_s, self.ttft_s, self.output_tokens)
        return {
            "ok": self.ok, "error": self.error, "num_images": self.num_images, "start_ms": ms(self.start_s),
            "ttft_ms": ms(self.ttft_s), "tpot_ms": ms(tpot), "e2e_ms": ms(self.e2e_s),
            "itl_ms": [ms(g) for g in self.itl_s], "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens, "tokens_from_usage": self.tokens_from_usage,
            "finish_reason": self.finish_reason, "output_chars": len(self.text),
        }


def _chunk_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta") or {}
    # Reasoning models on vLLM/SGLang stream thoughts in a separate field; they are output tokens too.
    return "".join(delta.get(k) or "" for k in ("reasoning_content", "reasoning", "content"))


def _chunk_tokens(choice: dict[str, Any]) -> bool:
    """Whether the chunk carries output tokens: text, or (with logprobs asked) tokens whose text is empty."""
    return bool(_chunk_text(choice) or ((choice.get("logprobs") or {}).get("content")))


async def stream_chat(client: httpx.AsyncClient, url: str, body: bytes, num_images: int = 0) -> RequestRecord:
    """POST one prebuilt streaming chat body and time it: TTFT at the first delta with tokens, ITL between
    later ones. Never raises for a failed request: the failure is the record's `error`."""
    rec = RequestRecord(num_images=num_images)
    chunks: list[str] = []
    done = False
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread())[:600].decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {raw}"
            else:
                decoder = SSEDecoder()
                async for line in resp.aiter_lines():
                    data = decoder.feed(line)
                    if data is None:
                        continue
                    now = time.perf_counter()
                    if data.strip() == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if event.get("error"):  # a failure after the 200 status line travels in-band
                        err = event["error"]
                        rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                        break
                    if event.get("usage"):
                        rec.prompt_tokens = event["usage"].get("prompt_tokens")
                        rec.output_tokens = int(event["usage"].get("completion_tokens") or 0)
                        rec.tokens_from_usage = True
                    rec.rid = rec.rid or str(event.get("id") or "")
                    for choice in event.get("choices") or []:
                        if _chunk_tokens(choice):
                            if TRACE_DIR:
                                rec.arrivals.append(time.monotonic())
                            if rec.ttft_s is None:
                                rec.ttft_s = now - start
                            else:
                                rec.itl_s.append(now - last)
                            last = now
                            chunks.append(_chunk_text(choice))
                        rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:  # malformed events fail the request, not the run
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.e2e_s = time.perf_counter() - start
    rec.text = "".join(chunks)
    if not rec.tokens_from_usage:
        rec.output_tokens = len(chunks)  # one chunk ~ one token when the server sends no usage
    if rec.error is None and not done and rec.finish_reason is None:
        rec.error = "stream ended without finish_reason or [DONE]"
    rec.ok = rec.error is None
    return rec


def write_arrivals(records: Sequence[RequestRecord]) -> None:
    """With GLIMPSE_STEP_TRACE=DIR set for the client too, its side of the token gaps: one record per request
    with the monotonic arrival time of each chunk that carried tokens, for ``benchmarks.tools.step_trace`` to set
    beside the frontend's sends (is a long gap the server's or the client's?)."""
    if not TRACE_DIR:
        return
    Path(TRACE_DIR).mkdir(parents=True, exist_ok=True)
    with open(Path(TRACE_DIR) / f"client-{os.getpid()}.jsonl", "a", encoding="utf-8") as out:
        for rec in records:
            if rec.rid:
                out.write(json.dumps({"kind": "chunks", "rid": rec.rid, "times": rec.arrivals}) + "\n")


# ---- plumbing shared by the modes ----------------------------------------------------------------


async def fetch_stats(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    """glimpse's /admin/stats, or None where the server has none (404 on vLLM/SGLang) or it fails."""
    try:
        resp = await client.get(url)
        stats = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):  # ValueError: a 200 that is not JSON (some proxy's page)
        return None
    return stats if isinstance(stats, dict) else None


def _client(args: argparse.Namespace, pool: int) -> httpx.AsyncClient:
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    # +2: the /models and /admin/stats calls must never wait behind a full pool of streams.
    limits = httpx.Limits(max_connections=pool + 2, max_keepalive_connections=pool + 2)
    return httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(args.timeout))


async def _resolve_model(client: httpx.AsyncClient, args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    resp = await client.get(args.base_url.rstrip("/") + "/models")
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def _image_urls(args: argparse.Namespace, sizes: Sequence[tuple[int, int]], seeds: Sequence[Sequence[int]],
                pool: ThreadPoolExecutor) -> list[str]:
    jobs = [pool.submit(image_data_url, w, h, seed, args.image_format) for (w, h), seed in zip(sizes, seeds)]
    return [job.result() for job in jobs]


# ---- modes ---------------------------------------------------------------------------------------


def _seeded(args: argparse.Namespace) -> tuple[np.random.Generator, Resolution]:
    """The run's random generator (seeded by --seed) and its --resolution."""
    return np.random.default_rng(args.seed), parse_resolution(args.resolution)


def _finish(
    args: argparse.Namespace, result: dict[str, Any], plot: PlotFn, table: Callable[[dict[str, Any]], str]
) -> dict[str, Any]:
    """Write the run's JSON and plot under --out and print its table."""
    report.write_result(result, args.out, plot)
    print(table(result))
    return result


async def run_serving(args: argparse.Namespace) -> dict[str, Any]:
    """Many independent requests, capped by --concurrency and/or paced by Poisson --request-rate."""
    (rng, res), n, k = _seeded(args), args.num_prompts, args.images_per_request
    sizes = [[res.sample(rng) for _ in range(k)] for _ in range(n)]
    texts = [random_text(rng, args.input_len) for _ in range(n)]
    # Poisson arrivals: exponential gaps. Drawn even for rate=inf so the RNG stream doesn't depend on it.
    gaps = rng.exponential(1.0, n) / args.request_rate if math.isfinite(args.request_rate) else np.zeros(n)
    url = args.base_url.rstrip("/") + "/chat/completions"
    async with _client(args, args.concurrency or n) as client:
        model = await _resolve_model(client, args)

        def build(i: int) -> bytes:  # distinct images per request: no server cache can short-cut the run
            urls = [image_data_url(w, h, (args.seed, 1, i, j), args.image_format) for j, (w, h) in enumerate(sizes[i])]
            return report.chat_body(args, model, [user_message(urls, texts[i])])

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            bodies = await asyncio.to_thread(lambda: list(pool.map(build, range(n))))
        admin = report.stats_url(args.base_url)
        before = await fetch_stats(client, admin)
        gate = asyncio.Semaphore(args.concurrency or n)
        start = time.perf_counter()

        async def one(body: bytes) -> RequestRecord:
            async with gate:
                sent = time.perf_counter() - start
                rec = await stream_chat(client, url, body, k)
                rec.start_s = sent
                return rec

        tasks: list[asyncio.Task[RequestRecord]] = []
        due = 0.0
        for body, gap in zip(bodies, gaps):
            due += float(gap)
            # Sleep to absolute due times so timer drift does not accumulate over a long run.
            if (delay := start + due - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(body)))
        done = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await fetch_stats(client, admin)
        write_arrivals(done)
        records = [r.to_json() for r in done]
    result = report.result_header(args, "serving", model)
    result["summary"] = report.summarize_serving(records, duration)
    result["server_gc"] = report.gc_during(before, after)
    result["requests"] = records
    return _finish(args, result, figures.plot_serving, report.serving_table)


async def run_multiturn(args: argparse.Namespace) -> dict[str, Any]:
    """One chat that adds an image per round and resends the whole history, as chat clients do."""
    rng, res = _seeded(args)
    sizes = [res.sample(rng) for _ in range(args.rounds)]
    texts = [random_text(rng, args.input_len) for _ in range(args.rounds)]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        seeds = [(args.seed, 2, r) for r in range(args.rounds)]
        urls = await asyncio.to_thread(_image_urls, args, sizes, seeds, pool)
    url, admin = args.base_url.rstrip("/") + "/chat/completions", report.stats_url(args.base_url)
    history: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    async with _client(args, 1) as client:
        model = await _resolve_model(client, args)
        for r in range(args.rounds):
            history.append(user_message([urls[r]], texts[r]))  # earlier images stay in history: resent as is
            body = await asyncio.to_thread(report.chat_body, args, model, history)
            before = await fetch_stats(client, admin)
            rec = await stream_chat(client, url, body, r + 1)
            after = await fetch_stats(client, admin)
            row = {"round": r + 1, **rec.to_json(), "images_encoded": report.stats_delta(before, after, "images_encoded"),
                   "mm_cache_hits": report.stats_delta(before, after, "mm_cache", "hits")}
            rounds.append(row)
            if not rec.ok:
                break  # no answer to put in the history: the chat cannot go on
            history.append({"role": "assistant", "content": rec.text})
    result = report.result_header(args, "multiturn", model)
    ok = [x for x in rounds if x["ok"]]
    result["summary"] = {"rounds_ok": len(ok), "rounds_failed": len(rounds) - len(ok),
                         "ttft_ms": [x["ttft_ms"] for x in ok], "images_encoded": [x["images_encoded"] for x in ok]}
    result["rounds"] = rounds
    return _finish(args, result, figures.plot_multiturn, report.multiturn_table)


async def run_probe(args: argparse.Namespace) -> dict[str, Any]:
    """One request per image count, growing until --max-images or the first failure."""
    rng, res = _seeded(args)
    url, admin = args.base_url.rstrip("/") + "/chat/completions", report.stats_url(args.base_url)
    probes: list[dict[str, Any]] = []
    async with _client(args, 1) as client:
        model = await _resolve_model(client, args)
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            for n in probe_counts(args.max_images, args.step):
                # Fresh images per step (seeded by n) so a per-image cache never hides the encode cost.
                sizes = [res.sample(rng) for _ in range(n)]
                urls = await asyncio.to_thread(_image_urls, args, sizes, [(args.seed, 3, n, j) for j in range(n)], pool)
                messages = [user_message(urls, random_text(rng, args.input_len))]
                body = await asyncio.to_thread(report.chat_body, args, model, messages)
                rec = await stream_chat(client, url, body, n)
                stats = await fetch_stats(client, admin)
                gpu = stats.get("gpu") if stats else None
                peak = gpu.get("peak_allocated_bytes") if isinstance(gpu, dict) else None
                probes.append({**rec.to_json(), "request_bytes": len(body), "peak_gpu_bytes": peak})
                if not rec.ok:
                    break
    result = report.result_header(args, "probe", model)
    ok = [p for p in probes if p["ok"]]
    failed = next((p for p in probes if not p["ok"]), None)
    result["summary"] = {"max_ok_images": max((p["num_images"] for p in ok), default=0), "probes": len(probes)}
    result["first_failure"] = None if failed is None else {"num_images": failed["num_images"], "error": failed["error"]}
    result["probes"] = probes
    return _finish(args, result, figures.plot_probe, report.probe_table)
