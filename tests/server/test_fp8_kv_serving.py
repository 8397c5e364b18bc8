"""`glimpse serve --kv-cache-dtype fp8` end to end (CPU, the demo, the official openai client): an image chat answers
what transformers answers when its attention sees K/V rounded through e4m3; /admin/stats and /metrics name the
cache's dtype, and the same --kv-cache-mb holds twice the blocks of a bf16 cache (four times float32's, the CPU's
model dtype); an unknown dtype is refused at start-up in one line."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.server.live import REPO, LiveServer, data_url, image_message, png_bytes, serving
from tests.workers.engine.models.fp8_reference import Fp8Reference
from workers.engine.config import EngineConfig
from workers.engine.models import load_spec
from workers.engine.runner.cache_memory import num_kv_blocks

KV_MB = 4
MAX_NEW = 10


@pytest.fixture(scope="module")
def fp8_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    yield from serving(demo_model_dir, "--device", "cpu", "--kv-cache-mb", str(KV_MB), "--kv-cache-dtype", "fp8")


def blocks(model_dir: Path, dtype: torch.dtype) -> int:
    """What --kv-cache-mb KV_MB holds in caches of ``dtype`` (the budget rule, no model needed)."""
    return num_kv_blocks(EngineConfig(model=str(model_dir)), load_spec(model_dir), dtype, 1, KV_MB << 20)


def test_image_chat_answers_as_the_rounded_reference(fp8_server: LiveServer, demo_model_dir: Path) -> None:
    image = png_bytes(300, 200, seed=42)
    reply = fp8_server.client().chat.completions.create(
        model="demo", messages=image_message("What is in this picture?", [data_url(image)]),  # type: ignore[arg-type]
        max_tokens=MAX_NEW, temperature=0.0,
    )
    reference = Fp8Reference(demo_model_dir)
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.open(io.BytesIO(image)).convert("RGB")},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    tokens = reference.generate(messages, MAX_NEW)
    assert reply.choices[0].message.content == reference.processor.decode(tokens, skip_special_tokens=True)


def test_stats_and_metrics_name_the_dtype_and_count_its_bytes(fp8_server: LiveServer, demo_model_dir: Path) -> None:
    stats = fp8_server.stats()
    assert stats["kv_cache_dtype"] == "fp8_e4m3"
    total = stats["kv_blocks"]["total"]
    assert total == blocks(demo_model_dir, torch.float8_e4m3fn) > 0
    # The same budget, floor-divided by half and a quarter of the bytes per block.
    assert 0 <= total - 2 * blocks(demo_model_dir, torch.bfloat16) <= 1
    assert 0 <= total - 4 * blocks(demo_model_dir, torch.float32) <= 3
    text = httpx.get(fp8_server.base + "/metrics", timeout=10).text
    info = [s.labels for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "vllm:cache_config_info"]
    assert info == [{"block_size": "16", "cache_dtype": "fp8_e4m3", "num_gpu_blocks": str(total)}]


def test_an_unknown_kv_cache_dtype_is_refused_at_start_up(demo_model_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(demo_model_dir), "--kv-cache-dtype", "fp8_e5m2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "--kv-cache-dtype" in last and "invalid choice: 'fp8_e5m2'" in last and "fp8_e4m3" in last


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_serving_on_cuda(demo_model_dir: Path) -> None:
    """On CUDA (bf16, decode graphs, the default attention backend): an image chat answers, and the same
    --kv-cache-mb holds twice the blocks of a bf16 cache (blocks of 128 tokens, the CUDA default)."""
    server = LiveServer(demo_model_dir, "--tokenizer-workers", "1", "--device", "cuda", "--kv-cache-mb", "64",
                        "--kv-cache-dtype", "fp8", ready_timeout=300)
    try:
        reply = server.client(timeout=120).chat.completions.create(
            model="demo", messages=image_message("What is in this picture?", [data_url(png_bytes(300, 200, 42))]),  # type: ignore[arg-type]
            max_tokens=MAX_NEW, temperature=0.0,
        )
        assert reply.choices[0].message.content
        stats = server.stats()
        spec = load_spec(demo_model_dir)
        bf16 = num_kv_blocks(EngineConfig(model="m", block_size=128), spec, torch.bfloat16, 1, 64 << 20)
        assert stats["kv_cache_dtype"] == "fp8_e4m3" and 0 <= stats["kv_blocks"]["total"] - 2 * bf16 <= 1
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fp8_tp2_answers_as_one_gpu(demo_model_dir: Path) -> None:
    """TP=2 (each rank its KV head and that head's scales; float32, so the two differ by rounding only): the same
    greedy answers as one GPU, with and without decode graphs."""
    answers = []
    for tp, env in ((("--tp", "1"), {}), (("--tp", "2"), {}), (("--tp", "2"), {"GLIMPSE_CUDA_GRAPHS": "0"})):
        server = LiveServer(demo_model_dir, *tp, "--device", "cuda", "--dtype", "float32", "--tokenizer-workers", "1",
                            "--kv-cache-dtype", "fp8", env=env, ready_timeout=300)
        try:
            client = server.client(timeout=120)
            answers.append([client.completions.create(model="demo", prompt=f"Count to {n}: " + "one " * n,
                                                      max_tokens=16, temperature=0).choices[0].text for n in (3, 40)])
        finally:
            assert server.stop() == 0, server.output()
    assert answers[0] == answers[1] == answers[2]
