"""Per-request output bounds (issue 40, docs/limits.md), through the real server and real clients: one request's
prompt log probabilities are held to ``--max-logprob-entries`` at admission (a 400 naming the field past it),
and an answer within the budget is rendered in slices, so the launcher's memory stays near the answer's packed
size and a small request beside it is answered promptly.

One server for the module (its start-up is most of the time): the big answer's test runs first, on a launcher
that has only answered a warm-up, so its peak RSS (VmHWM) measures that request alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ipc.prompts import SamplingParams
from tests.server.live import LiveServer, serving
from workers.common.errors import BadRequest
from workers.tokenizer.requests.sampling import SamplingFields, hold_to_budget

BUDGET = 600_000  # entries: a ~20 MB answer of the demo model, small enough for CI
K = 20  # the logprobs and prompt_logprobs
PER_TOKEN = 1 + (1 + K) + (1 + K)  # an echoed token, its echo logprobs, its prompt_logprobs (docs/limits.md)
# The launcher's peak RSS growth allowed for the big answer. Before issue 40 it built the whole answer as Python
# objects, then JSON: ~5 MiB per MiB of answer (+1,491 MiB for a 307 MiB one), ~125 MiB here; now +5.
RSS_BOUND_MIB = 32
WORDS = " ".join("invoice" if i % 2 else f"row{i % 89} total" for i in range(450))


@pytest.fixture(scope="module")
def live(demo_model_dir: Path) -> Iterator[LiveServer]:
    yield from serving(demo_model_dir, "--max-logprob-entries", str(BUDGET), "--max-model-len", "4096")


def peak_rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmHWM")


def big_body(live: LiveServer, prompts: int) -> dict[str, Any]:
    """The issue's request shape (echo + logprobs 20 + prompt_logprobs 20, a batch of text prompts), sized to
    ``prompts`` prompts; asserts it is within the budget (the server counts the same tokens)."""
    texts = [f"{p} {WORDS}" for p in range(prompts)]
    tokens = sum(len(live_tokens(live, t)) for t in texts)
    assert tokens * PER_TOKEN <= BUDGET
    return {"model": "demo", "prompt": texts, "echo": True, "logprobs": K, "prompt_logprobs": K, "max_tokens": 1,
            "temperature": 0}  # fmt: skip


def live_tokens(live: LiveServer, text: str) -> list[int]:
    out = httpx.post(live.base + "/tokenize", json={"model": "demo", "prompt": text}, timeout=30).json()
    return list(out["tokens"])


def small(live: LiveServer) -> float:
    started = time.monotonic()
    resp = httpx.post(live.base + "/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 1}, timeout=120)
    assert resp.status_code == 200
    return time.monotonic() - started


def test_a_big_answer_within_the_budget_keeps_the_launcher_small_and_its_loop_free(live: LiveServer) -> None:
    """The big answer's peak launcher RSS, and small requests sent while the frontend renders it (one request
    for both: it is most of this module's time)."""
    warm = {"model": "demo", "prompt": ["Total: 4", "Sum"], "echo": True, "logprobs": K, "prompt_logprobs": K, "max_tokens": 1}
    assert httpx.post(live.base + "/v1/completions", json=warm, timeout=60).status_code == 200
    body = big_body(live, 12)
    done = threading.Event()
    result: list[httpx.Response] = []

    def big() -> None:
        try:
            result.append(httpx.post(live.base + "/v1/completions", json=body, timeout=300))
        finally:
            done.set()

    before, generated = peak_rss_mib(live.proc.pid), live.stats()["generated_tokens"]
    thread = threading.Thread(target=big)
    thread.start()
    # Its prefill first (small requests queue behind it in the scheduler, which is not what this is about): once
    # the scheduler counts its 12 tokens, their outputs are with the frontend, which renders the answer from then.
    while not done.is_set() and live.stats()["generated_tokens"] < generated + 12:
        time.sleep(0.05)
    waits = []
    while not done.is_set():
        waits.append(small(live))
    thread.join()
    grown = peak_rss_mib(live.proc.pid) - before
    (resp,) = result
    assert resp.status_code == 200, resp.text
    size = len(resp.content)
    out = resp.json()
    assert size > 12 << 20  # the answer is big: what the bound is about
    assert [c["index"] for c in out["choices"]] == list(range(12))
    for choice in out["choices"]:
        n = len(choice["prompt_logprobs"])
        assert n == len(choice["logprobs"]["tokens"]) - 1  # the prompt, then the one generated token
        assert choice["prompt_logprobs"][0] is None and all(len(e) >= K for e in choice["prompt_logprobs"][1:])
        assert all(t for t in choice["logprobs"]["top_logprobs"][1:])  # keyed by text: some alternatives share one
    assert out["usage"]["prompt_tokens"] * PER_TOKEN <= BUDGET
    print(f"launcher peak RSS +{grown} MiB for a {size / 2**20:.1f} MiB answer; small requests meanwhile: {waits}")
    assert grown < RSS_BOUND_MIB, f"launcher peak RSS grew {grown} MiB for a {size >> 20} MiB answer"
    assert len(waits) >= 2, waits  # the small ones ran while the big one was written
    # Before issue 40 the big answer was rendered in one go on the event loop: ~5 s of nothing else.
    assert max(waits) < 2.5, waits


def test_past_the_budget_is_a_400_naming_the_field(live: LiveServer) -> None:
    client = live.client()
    computed = live.stats()["prompt_tokens"]
    long_text = " ".join([WORDS] * 2)  # ~2,200 tokens: x 43 entries each, x 8 choices, past the budget
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt=long_text, echo=True, logprobs=K, max_tokens=1, n=8,
                                  extra_body={"prompt_logprobs": K})  # fmt: skip
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == "prompt_logprobs" and error["code"] == "logprob_budget_exceeded"
    assert f"{BUDGET:,}" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:  # echo with logprobs alone: the field is logprobs
        client.completions.create(model="demo", prompt=[long_text] * 16, echo=True, logprobs=K, max_tokens=1)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as info:  # generated tokens of a whole answer: max_tokens
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                       top_logprobs=K, n=16, max_tokens=2000)  # fmt: skip
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:  # a stop string past 1,024 characters (checked per step)
        client.completions.create(model="demo", prompt="hi", max_tokens=1, stop=["x" * 1025])
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "stop"
    assert live.stats()["prompt_tokens"] == computed  # refused at admission: the scheduler never saw them
    # Streamed, those tokens are written as they come: the same request is served. Its entries are counted, not its
    # chunks: a loaded machine may hand the frontend a choice's two tokens in one message, which is one chunk.
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=K, n=16,
        max_tokens=2, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    entries = [e for chunk in stream for c in chunk.choices if c.logprobs and c.logprobs.content for e in c.logprobs.content]
    assert len(entries) == 32 and all(len(e.top_logprobs) == K for e in entries)
    # Nothing else broke: an ordinary request and a loglikelihood one right after.
    assert small(live) < 30
    ok = client.completions.create(model="demo", prompt=WORDS, echo=True, logprobs=1, max_tokens=0)
    assert ok.usage is not None and ok.choices[0].logprobs is not None
    assert len(ok.choices[0].logprobs.tokens or []) == ok.usage.prompt_tokens


def fields(**kw: Any) -> SamplingFields:
    return SamplingFields(model="demo", **kw)


def test_hold_to_budget_lowers_a_default_max_tokens_and_refuses_a_sent_one() -> None:
    params = SamplingParams(max_tokens=8000, logprobs=20, n=4)  # 4 x (1 + 21) entries a token
    assert hold_to_budget(params, fields(), 100_000).max_tokens == 100_000 // 88  # left to the server: lowered
    assert hold_to_budget(params, fields(), 100_000, prompt_entries=12_000).max_tokens == 88_000 // 88
    with pytest.raises(BadRequest) as info:
        hold_to_budget(params, fields(max_tokens=8000), 100_000)
    assert info.value.param == "max_tokens" and "at most 1136 tokens" in info.value.message
    assert hold_to_budget(params, fields(max_tokens=8000, stream=True), 100_000) is params  # streamed: not held
    # Without logprobs a generated token is 1 entry (its text), a batch's choices counted, not n.
    plain = SamplingParams(max_tokens=300)
    assert hold_to_budget(plain, fields(max_tokens=300), 300_000, choices=1000) is plain
    with pytest.raises(BadRequest) as info:
        hold_to_budget(plain, fields(max_tokens=300), 262_144, choices=1024, prompt_param="prompt")
    assert info.value.param == "max_tokens"
    with pytest.raises(BadRequest) as info:
        hold_to_budget(params, fields(stream=True), 100_000, prompt_entries=100_001, prompt_param="prompt")
    assert info.value.param == "prompt"
