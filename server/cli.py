"""The `glimpse` command line: one subcommand per job, heavy imports deferred until a subcommand runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from server.serve_cli import add_serve

Handler = Callable[[argparse.Namespace], int]


def _run_demo_model(args: argparse.Namespace) -> int:
    from workers.engine.models.demo_writer import write_demo_model

    path = write_demo_model(args.path, args.family, args.quantize)
    fp8 = f" in {args.quantize}" if args.quantize else ""
    print(f"wrote the {args.family} demo model (random weights){fp8} to {path}")
    return 0


def _add_demo_model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from workers.engine.models import DEMO_FAMILIES  # a plain dict: torch is imported only when a family is

    p = sub.add_parser(
        "demo-model",
        help="write a tiny random-weight demo checkpoint (Qwen2.5-VL by default)",
        description="Write a tiny checkpoint of a supported model family with random weights into PATH. The "
        "output is identical on every run and needs no network; its answers are noise.",
    )
    p.add_argument("path", metavar="PATH", type=Path, help="directory to write (created if missing)")
    p.add_argument("--family", default="qwen2_5_vl", choices=sorted(DEMO_FAMILIES), help="model family")
    p.add_argument(
        "--quantize",
        choices=("fp8-block", "fp8-dynamic"),
        help="write the language model's Linear weights in FP8: fp8-block as Qwen's -FP8 repos (128x128 blocks, "
        "weight_scale_inv), fp8-dynamic as llm-compressor's FP8_DYNAMIC (compressed-tensors, per-channel)",
    )
    p.set_defaults(handler=_run_demo_model)


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Imported here, not at the top: the load generator is a client-side tool the server never needs.
    from benchmarks.serving.bench_cli import add_bench

    add_bench(sub)


# Each subcommand contributes one `_add_<name>(sub)` that registers its parser and sets `handler`.
# `serve` (the OpenAI-compatible server) and `bench` (benchmark scripts) are added here next to demo-model.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _add_demo_model,
    add_serve,
    _add_bench,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glimpse",
        description="glimpse: an OpenAI-compatible server for vision-language models.",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `glimpse` console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
