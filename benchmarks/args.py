"""Command-line pieces every benchmark script shares."""

from __future__ import annotations

import argparse


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose ``--help`` prints the script's docstring as written, its example commands included."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def engine_flags(
    ap: argparse.ArgumentParser, *, images: int = 8, chunk_size: int = 1024, kv_cache_mb: int | None = 16384,
    decode_tokens: int = 128,
) -> None:
    """The flags of the engine benchmarks: images in the TTFT request, the step's token budget, the KV cache
    (None: the engine's default for the device) and tokens per sequence in the decode runs."""
    ap.add_argument("--images", type=int, default=images, help="images in the TTFT request")
    ap.add_argument("--chunk-size", type=int, default=chunk_size, help="token budget of a step")
    ap.add_argument("--kv-cache-mb", type=int, default=kv_cache_mb)
    ap.add_argument("--decode-tokens", type=int, default=decode_tokens, help="tokens per sequence in the decode runs")
