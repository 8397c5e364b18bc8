"""`glimpse bench`'s command line: the serving, multiturn and probe modes, their flags (checked at parse time, before
any server is contacted), and running the chosen mode on an event loop. The modes themselves are in
bench_client.py."""

from __future__ import annotations

import argparse
import asyncio
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving import bench_client, bench_plot as report
from benchmarks.serving.bench_plot import parse_resolution


def _positive(kind: Callable[[str], float], zero_ok: bool = False) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'>=' if zero_ok else '>'} 0, got {text}")
        return value

    return parse


def _resolution(spec: str) -> str:
    try:
        parse_resolution(spec)  # fail at parse time, not after the server was contacted
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def _common(p: argparse.ArgumentParser, output_len: int) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the OpenAI API root (ends in /v1)")
    p.add_argument("--model", default=None, help="model name to send; unset: the first of GET /models")
    # Read from the environment at run time, not as the default: --help would print a default key.
    p.add_argument("--api-key", default=None, help="bearer token; unset: $OPENAI_API_KEY if set")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="directory for the JSON and PNG")
    # Same seed, same image bytes: a server with an image cache (glimpse, vLLM) would serve a rerun from it.
    p.add_argument("--seed", type=int, default=0, help="seeds images, texts, arrivals; vary it between runs "
                   "against one server, or its image cache serves the repeats")
    p.add_argument("--timeout", type=_positive(float), default=600.0, help="seconds per HTTP request")
    p.add_argument("--resolution", type=_resolution, default="1080p", help="720p, 1080p, 2k, WxH or random:WxH-WxH")
    p.add_argument("--image-format", default="jpeg", choices=sorted(report.MIME))
    p.add_argument("--input-len", type=_positive(int), default=32, help="approximate words of text per user turn")
    p.add_argument("--output-len", type=_positive(int), default=output_len, help="max_tokens of each request")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so answers run to --output-len (servers that support it)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--logprobs", action=argparse.BooleanOptionalAction, default=False,
                   help="send logprobs and time tokens by their logprobs, so a token that decodes to no text (random "
                   "weights) still counts for TTFT and inter-token gaps")


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `glimpse bench {serving,multiturn,probe}`."""
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (glimpse, vLLM, SGLang)",
                           description=bench_client.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = bench.add_subparsers(title="modes", metavar="MODE", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = modes.add_parser("serving", help="throughput and latency under load", formatter_class=fmt)
    _common(p, 128)
    p.add_argument("--num-prompts", type=_positive(int), default=100)
    p.add_argument("--concurrency", type=_positive(int), default=None, help="most requests in flight; unset: no cap")
    p.add_argument("--request-rate", type=_positive(float), default=math.inf, help="Poisson arrivals per second; inf = all at once")
    p.add_argument("--images-per-request", type=_positive(int, zero_ok=True), default=1)
    p.set_defaults(handler=run_bench, runner=bench_client.run_serving)
    p = modes.add_parser("multiturn", help="one chat adding an image per round", formatter_class=fmt)
    _common(p, 32)
    p.add_argument("--rounds", type=_positive(int), default=8)
    p.set_defaults(handler=run_bench, runner=bench_client.run_multiturn)
    p = modes.add_parser("probe", help="TTFT and memory as images per request grow", formatter_class=fmt)
    _common(p, 8)
    p.add_argument("--max-images", type=_positive(int), default=32)
    p.add_argument("--step", type=_positive(int), default=1)
    p.set_defaults(handler=run_bench, runner=bench_client.run_probe)


def run_bench(args: argparse.Namespace) -> int:
    """Run the chosen mode; exit 1 when it produced nothing useful (no successful request)."""
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop  # a faster loop keeps the client's own overhead out of the latencies

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            result: dict[str, Any] = runner.run(args.runner(args))
    except httpx.HTTPError as exc:  # the server is unreachable or /models failed: no run happened
        print(f"glimpse bench: {args.base_url}: {type(exc).__name__}: {exc}")
        return 1
    print(f"\nwrote {result['files']['json']} and {result['files']['png']}")
    ok = {"serving": result["summary"].get("completed"), "multiturn": result["summary"].get("rounds_ok"),
          "probe": result["summary"].get("max_ok_images")}[result["mode"]]
    return 0 if ok else 1
