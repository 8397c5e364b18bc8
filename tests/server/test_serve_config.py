"""`glimpse serve`'s flags as they become the frozen config: defaults that depend on the device."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from server.serve_cli import add_serve, build_config
from workers.engine.config import FA3_KEY_TILE, EngineConfig, serving_block_size


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("device", "backend", "num_kv_blocks", "expected"),
    [
        ("cuda", "auto", None, FA3_KEY_TILE),  # FA3 loads whole key tiles of a block with TMA
        ("cuda:1", "fa3", None, FA3_KEY_TILE),
        ("cuda", "flash", None, 16),  # a backend that gathers the blocks gains nothing from larger ones
        ("cuda", "sdpa", None, 16),
        ("cuda", "auto", 12288, 16),  # a count sized in blocks of 16 keeps its meaning (and fits its card)
        ("cpu", "auto", None, 16),
    ],
)
def test_serving_block_size_follows_device_backend_and_an_explicit_block_count(
    device: str, backend: str, num_kv_blocks: int | None, expected: int
) -> None:
    assert FA3_KEY_TILE == 128 and EngineConfig.block_size == 16
    assert serving_block_size(device, backend, num_kv_blocks) == expected


def test_serve_takes_the_default_block_size_or_the_one_given(demo_model_dir: Path) -> None:
    assert build_config(parse("--model", str(demo_model_dir), "--device", "cpu")).engine.block_size == 16
    given = build_config(parse("--model", str(demo_model_dir), "--device", "cpu", "--block-size", "128"))
    assert given.engine.block_size == 128


def test_serve_refuses_a_block_size_below_one(demo_model_dir: Path) -> None:
    with pytest.raises(SystemExit, match="--block-size"):
        build_config(parse("--model", str(demo_model_dir), "--device", "cpu", "--block-size", "0"))
