"""`glimpse bench`: the pure parts (statistics, images, SSE) and all three modes against a real server."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from benchmarks.serving import bench_plot as report
from benchmarks.serving.bench_client import SSEDecoder, parse_sse, run_multiturn, run_probe, stream_chat
from server.cli import build_parser, main
from tests.server.live import LiveServer

# A stream as glimpse sent it (curl -N, max_tokens 3, include_usage), blank separator lines included.
RECORDED = """\
data: {"id":"chatcmpl-e2","object":"chat.completion.chunk","created":1795662464,"model":"demo","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null,"logprobs":null}]}

data: {"id":"chatcmpl-e2","object":"chat.completion.chunk","created":1795662464,"model":"demo","choices":[{"index":0,"delta":{"content":" CHECKS"},"finish_reason":null,"logprobs":null}]}

data: {"id":"chatcmpl-e2","object":"chat.completion.chunk","created":1795662464,"model":"demo","choices":[{"index":0,"delta":{"content":"AUSE"},"finish_reason":null,"logprobs":null}]}

data: {"id":"chatcmpl-e2","object":"chat.completion.chunk","created":1795662464,"model":"demo","choices":[{"index":0,"delta":{"content":"or"},"finish_reason":null,"logprobs":null}]}

data: {"id":"chatcmpl-e2","object":"chat.completion.chunk","created":1795662464,"model":"demo","choices":[{"index":0,"delta":{},"finish_reason":"length","logprobs":null}]}

data: {"id":"chatcmpl-e2","object":"chat.completion.chunk","created":1795662464,"model":"demo","choices":[],"usage":{"prompt_tokens":30,"completion_tokens":3,"total_tokens":33}}

data: [DONE]

"""
SMALL = "random:64x64-160x120"  # tiny images: the demo model on a CPU


# ---- statistics ----------------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert report.percentile(values, 0) == 1.0
    assert report.percentile(values, 50) == 2.5
    assert report.percentile(values, 100) == 4.0
    assert report.percentile(values, 99) == pytest.approx(3.97)
    assert report.percentile([7.0], 99) == 7.0
    assert report.percentile([], 50) is None
    with pytest.raises(ValueError):
        report.percentile(values, 101)
    rng = np.random.default_rng(3)
    sample = rng.exponential(1.0, 257).tolist()
    for q in (1, 25, 50, 90, 99, 99.9):
        assert report.percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))


def test_describe_ms_and_tpot() -> None:
    assert report.describe_ms([0.001, 0.002, 0.003]) == {"mean": 2.0, "median": 2.0, "p90": 2.8, "p99": 2.98,
                                                         "max": 3.0}
    assert report.describe_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None,
                                      "max": None}
    assert report.tpot_s(e2e_s=1.0, ttft_s=0.2, output_tokens=5) == pytest.approx(0.2)
    assert report.tpot_s(e2e_s=1.0, ttft_s=0.2, output_tokens=1) is None


def record(ok: bool = True, ttft: float = 100.0, e2e: float = 400.0, tokens: int = 4, **kw: Any) -> dict[str, Any]:
    base = {"ok": ok, "error": None if ok else "HTTP 503: busy", "ttft_ms": ttft if ok else None,
            "tpot_ms": (e2e - ttft) / (tokens - 1) if ok else None, "e2e_ms": e2e, "itl_ms": [100.0] * (tokens - 1),
            "output_tokens": tokens if ok else 0, "prompt_tokens": 50 if ok else None}
    return {**base, **kw}


def test_summarize_serving_counts_only_successes() -> None:
    records = [record(), record(ttft=200.0, e2e=500.0), record(ok=False), record(ok=False)]
    s = report.summarize_serving(records, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 2)
    assert s["request_throughput"] == 1.0
    assert s["output_throughput"] == 4.0  # 8 tokens / 2 s
    assert s["total_token_throughput"] == 54.0  # (8 + 100) / 2 s
    assert s["ttft_ms"]["mean"] == 150.0 and s["ttft_ms"]["median"] == 150.0
    assert s["e2e_ms"]["max"] == 500.0
    assert s["itl_ms"]["median"] == 100.0
    assert s["errors"] == {"HTTP 503: busy": 2}
    assert "TTFT" in report.serving_table({"model": "m", "summary": s})


def test_probe_counts_and_stats_helpers() -> None:
    assert report.probe_counts(3, 1) == [1, 2, 3]
    assert report.probe_counts(32, 8) == [1, 8, 16, 24, 32]
    assert report.probe_counts(10, 4) == [1, 4, 8]
    before = {"images_encoded": 3, "mm_cache": {"hits": 1}}
    after = {"images_encoded": 4, "mm_cache": {"hits": 3}}
    assert report.stats_delta(before, after, "images_encoded") == 1
    assert report.stats_delta(before, after, "mm_cache", "hits") == 2
    assert report.stats_delta(None, after, "images_encoded") is None
    assert report.stats_delta(before, after, "gpu", "peak_allocated_bytes") is None
    assert report.stats_url("http://h:8000/v1") == report.stats_url("http://h:8000/v1/") == "http://h:8000/admin/stats"
    gc_row = {"full_collections": 1, "pause_ms_sum": 2.5, "idle_full_collections": 0}
    gc_before = {"scheduler_gc": gc_row, "model_workers": [{"gc": gc_row}]}
    gc_after = {"scheduler_gc": {**gc_row, "pause_ms_sum": 3.0},
                "model_workers": [{"gc": {"full_collections": 3, "pause_ms_sum": 90.5, "idle_full_collections": 2}}]}
    assert report.gc_during(gc_before, gc_after) == [
        {"process": "scheduler", "full_collections": 0, "pause_ms_sum": 0.5, "idle_full_collections": 0},
        {"process": "model rank 0", "full_collections": 2, "pause_ms_sum": 88.0, "idle_full_collections": 2},
    ]
    assert report.gc_during(None, gc_after) == []  # vLLM and SGLang have no /admin/stats


# ---- images --------------------------------------------------------------------------------------


def test_parse_resolution() -> None:
    assert report.parse_resolution("1080p") == report.Resolution((1920, 1080), (1920, 1080))
    assert report.parse_resolution("2K").max_wh == (2560, 1440)
    assert report.parse_resolution("300x200").min_wh == (300, 200)
    res = report.parse_resolution(SMALL)
    assert (res.min_wh, res.max_wh) == ((64, 64), (160, 120))
    rng = np.random.default_rng(0)
    sizes = [res.sample(rng) for _ in range(200)]
    assert all(64 <= w <= 160 and 64 <= h <= 120 for w, h in sizes)
    assert len(set(sizes)) > 50  # actually random, not stuck on the bounds
    for bad in ("4k", "random:64x64", "0x10", "axb"):
        with pytest.raises(ValueError):
            report.parse_resolution(bad)


@pytest.mark.parametrize("fmt,pil_format", [("jpeg", "JPEG"), ("png", "PNG")])
def test_images_are_deterministic_and_sized(fmt: str, pil_format: str) -> None:
    a = report.make_image(160, 90, (7, 1))
    assert a.shape == (90, 160, 3) and a.dtype == np.uint8
    assert np.array_equal(a, report.make_image(160, 90, (7, 1)))
    assert not np.array_equal(a, report.make_image(160, 90, (7, 2)))
    assert a.std() > 20  # not a flat colour: structure and noise are there
    url = report.image_data_url(160, 90, 7, fmt)
    assert url == report.image_data_url(160, 90, 7, fmt)  # same bytes on every run: comparable across servers
    prefix, b64 = url.split(",", 1)
    assert prefix == f"data:image/{fmt};base64"
    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert img.format == pil_format and img.size == (160, 90) and img.mode == "RGB"


# ---- SSE -----------------------------------------------------------------------------------------


def test_parse_recorded_stream() -> None:
    events = parse_sse(RECORDED.splitlines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == " CHECKSAUSEor"
    assert chunks[-1]["usage"] == {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}


def test_sse_decoder_follows_the_spec() -> None:
    lines = [": keep-alive", "event: message", "data:{\"a\":1}", "", "data: line1", "data:  line2", "id: 7", "",
             "", "data: tail"]
    assert parse_sse(lines) == ['{"a":1}', "line1\n line2", "tail"]
    decoder = SSEDecoder()
    assert decoder.feed("data: x") is None and decoder.feed("") == "x" and decoder.feed("") is None


def replay(body: bytes, status: int = 200) -> httpx.AsyncClient:
    """A client whose every POST is answered with `body` (in 7-byte pieces, as a slow network would)."""

    async def stream() -> Any:
        for i in range(0, len(body), 7):
            yield body[i : i + 7]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=stream(), headers={"content-type": "text/event-stream"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_stream_chat_times_a_recorded_stream() -> None:
    for body in (RECORDED.encode(), RECORDED.replace("\n", "\r\n").encode()):
        async with replay(body) as client:
            rec = await stream_chat(client, "http://x/v1/chat/completions", b"{}", num_images=2)
        assert rec.ok and rec.error is None
        assert rec.text == " CHECKSAUSEor" and rec.finish_reason == "length"
        assert (rec.output_tokens, rec.prompt_tokens, rec.tokens_from_usage) == (3, 30, True)
        assert rec.ttft_s is not None and rec.e2e_s is not None and 0 < rec.ttft_s <= rec.e2e_s
        assert len(rec.itl_s) == 2  # three content chunks: the role chunk's "" is not a token
        row = rec.to_json()
        assert row["num_images"] == 2 and row["tpot_ms"] is not None and len(row["itl_ms"]) == 2


async def test_stream_chat_counts_tokens_without_text_by_their_logprobs() -> None:
    # Random weights often answer with tokens that decode to nothing: only their logprobs show them.
    lp = '"logprobs":{"content":[{"token":"","logprob":-1.0,"bytes":[],"top_logprobs":[]}]}'
    empty = RECORDED.replace('"delta":{"content":" CHECKS"},"finish_reason":null,"logprobs":null',
                             '"delta":{"content":""},"finish_reason":null,' + lp)
    assert empty != RECORDED
    async with replay(empty.encode()) as client:
        rec = await stream_chat(client, "http://x", b"{}")
    assert rec.ok and rec.text == "AUSEor"
    assert rec.ttft_s is not None and len(rec.itl_s) == 2  # the empty token is the first, not the role chunk


async def test_stream_chat_records_failures() -> None:
    async with replay(b'{"error":{"message":"too many images"}}', status=400) as client:
        rec = await stream_chat(client, "http://x", b"{}")
    assert not rec.ok and rec.error is not None and rec.error.startswith("HTTP 400") and "too many images" in rec.error
    in_band = RECORDED.split("data: [DONE]")[0].replace('"usage"', '"x"') + 'data: {"error":{"message":"boom"}}\n\n'
    async with replay(in_band.encode()) as client:
        rec = await stream_chat(client, "http://x", b"{}")
    assert rec.error == "stream error: boom"
    async with replay(b"data: [1, 2]\n\n") as client:  # valid JSON, not an event object
        rec = await stream_chat(client, "http://x", b"{}")
    assert not rec.ok and (rec.error or "").startswith("AttributeError")
    cut = "\n\n".join(RECORDED.split("\n\n")[:3]) + "\n\n"  # connection closed mid-answer, no usage
    async with replay(cut.encode()) as client:
        rec = await stream_chat(client, "http://x", b"{}")
    assert not rec.ok and "ended" in (rec.error or "")
    assert rec.output_tokens == 2 and not rec.tokens_from_usage  # counted from chunks


def test_cli_flags() -> None:
    args = build_parser().parse_args(["bench", "serving"])
    assert (args.base_url, args.ignore_eos, args.concurrency, args.request_rate) == (
        "http://127.0.0.1:8000/v1", True, None, math.inf)
    assert build_parser().parse_args(["bench", "probe", "--no-ignore-eos"]).ignore_eos is False
    for bad in (["serving", "--concurrency", "0"], ["probe", "--resolution", "big"], ["multiturn", "--rounds", "-1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", *bad])


# ---- against a real glimpse server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def live(demo_model_dir: Path) -> Iterator[LiveServer]:
    # A 3-image cap lets the probe meet a real rejection at 4.
    server = LiveServer(demo_model_dir, "--tokenizer-workers", "1", "--max-images-per-request", "3")
    yield server
    assert server.stop() == 0, server.output()
    assert server.segments() == []


def bench_args(live: LiveServer, mode: str, out: Path, *extra: str) -> argparse.Namespace:
    argv = ["bench", mode, "--base-url", live.base + "/v1", "--resolution", SMALL, "--out", str(out), *extra]
    return build_parser().parse_args(argv)


def only_result(out: Path, mode: str) -> dict[str, Any]:
    (json_path,) = out.glob(f"{mode}-*.json")
    (png_path,) = out.glob(f"{mode}-*.png")
    result: dict[str, Any] = json.loads(json_path.read_text())
    assert result["files"] == {"json": str(json_path), "png": str(png_path)}
    with Image.open(png_path) as img:
        img.verify()  # a whole, valid PNG
        assert img.format == "PNG"
    return result


def test_serving_through_the_cli(live: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serving", "--base-url", live.base + "/v1", "--resolution", SMALL, "--out", str(tmp_path),
            "--num-prompts", "6", "--concurrency", "3", "--images-per-request", "1", "--output-len", "4"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "request throughput" in printed and "garbage collections" in printed
    result = only_result(tmp_path, "serving")
    assert [g["process"] for g in result["server_gc"]] == ["frontend", "scheduler", "model rank 0"]
    assert result["model"] == "demo"  # found through GET /v1/models
    s = result["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (6, 0, 24)
    assert s["request_throughput"] > 0 and s["ttft_ms"]["p99"] is not None and s["tpot_ms"]["mean"] is not None
    assert len(result["requests"]) == 6
    for r in result["requests"]:
        assert r["ok"] and r["output_tokens"] == 4 and r["tokens_from_usage"] and r["finish_reason"] == "length"
        assert r["num_images"] == 1 and r["prompt_tokens"] > 4 and r["ttft_ms"] <= r["e2e_ms"]


def test_multiturn_encodes_one_new_image_per_round(live: LiveServer, tmp_path: Path) -> None:
    args = bench_args(live, "multiturn", tmp_path, "--rounds", "3", "--output-len", "4", "--seed", "11", "--logprobs")
    result = asyncio.run(run_multiturn(args))
    assert result == only_result(tmp_path, "multiturn")
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3] and all(r["ok"] for r in rounds)
    ttfts = result["summary"]["ttft_ms"]  # timed by logprobs: every round has one, text or not
    assert len(ttfts) == 3 and all(t is not None and t > 0 for t in ttfts)
    assert [r["num_images"] for r in rounds] == [1, 2, 3]
    # Images of earlier rounds are resent byte for byte; glimpse's per-image cache encodes only the new one.
    assert [r["images_encoded"] for r in rounds[1:]] == [1, 1]
    # Earlier images are either inside the reused KV prefix (nothing to look up) or cache hits.
    assert all(0 <= r["mm_cache_hits"] <= r["num_images"] - 1 for r in rounds[1:])
    assert rounds[0]["prompt_tokens"] < rounds[1]["prompt_tokens"] < rounds[2]["prompt_tokens"]


def test_probe_grows_until_the_first_failure(live: LiveServer, tmp_path: Path) -> None:
    result = asyncio.run(run_probe(bench_args(live, "probe", tmp_path / "a", "--max-images", "3")))
    probes = result["probes"]
    assert [p["num_images"] for p in probes] == [1, 2, 3] and all(p["ok"] for p in probes)
    assert all(p["prompt_tokens"] > 0 and p["ttft_ms"] is not None for p in probes)
    assert all(p["peak_gpu_bytes"] is None for p in probes)  # a CPU server reports no GPU memory
    assert result["first_failure"] is None and result["summary"]["max_ok_images"] == 3
    only_result(tmp_path / "a", "probe")

    result = asyncio.run(run_probe(bench_args(live, "probe", tmp_path / "b", "--max-images", "6", "--seed", "5")))
    assert [p["num_images"] for p in result["probes"]] == [1, 2, 3, 4]  # stopped at the first failure
    assert result["first_failure"]["num_images"] == 4
    assert result["first_failure"]["error"].startswith("HTTP 400")
    assert result["summary"]["max_ok_images"] == 3
