"""Data parallelism end to end: `glimpse serve --dp 2` on the CPU (demo model), real processes, one server
for the module. Answers equal the one-engine reference; a chat keeps landing where its images are while
unrelated load spreads; KV-cache events of both replicas reach one ZMQ subscriber on one stream in vLLM 0.24's
format, keyed the way llm-d's indexer keys the request (tests/llmd_index.py), removals after eviction, and a gap
replayed; /metrics carries the gateway gauges; one image served by both replicas
is one segment with a name per replica; and last, a replica killed under load fails what was in flight,
stops the server and leaves no shared memory."""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from ipc.kv_events import external_hash
from ipc.prompts import SamplingParams
from tests.llmd_index import Index, decode_batch
from tests.server.live import LiveServer, data_url, free_port, image_message, png_bytes
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine
from workers.engine.prompt.processor import MMProcessor

KV_BLOCKS = 64  # per replica: small, so a little traffic evicts


class EventLog:
    """A SUB socket bound on the server's event port (the server connects, as to an indexer that binds),
    drained by a thread from before the server starts, so no batch is missed: frames kept as they came."""

    def __init__(self) -> None:
        self.port, self.replay_port = free_port(), free_port()
        self.frames: list[tuple[bytes, int, bytes]] = []  # (topic, seq, payload)
        self._stop, self._ready = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(f"tcp://127.0.0.1:{self.port}")
        self._ready.set()
        while not self._stop.is_set():
            if sub.poll(50):
                topic, seq, payload = sub.recv_multipart()
                self.frames.append((topic, int.from_bytes(seq, "big"), payload))
        sub.close(linger=0)
        ctx.term()

    def batches(self) -> list[tuple[float, list[dict[str, Any]], int | None]]:
        return [decode_batch(payload) for _, _, payload in list(self.frames)]  # strictly vLLM 0.24's layout

    def events(self, replica: int | None = None) -> list[dict[str, Any]]:
        return [e for _, events, rank in self.batches() if replica in (None, rank) for e in events]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture(scope="module")
def events() -> Iterator[EventLog]:
    log = EventLog()
    yield log
    log.close()


@pytest.fixture(scope="module")
def dp2(demo_model_dir: Path, events: EventLog) -> Iterator[LiveServer]:
    server = LiveServer(
        demo_model_dir, "--dp", "2", "--tokenizer-workers", "1", "--max-model-len", "2048",
        "--num-kv-blocks", str(KV_BLOCKS), "--kv-events-endpoint", f"tcp://127.0.0.1:{events.port}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{events.replay_port}", "--kv-events-buffer-steps", "100000",
    )
    yield server
    server.finish()  # the last test killed a replica: the server stopped on its own


@pytest.fixture(scope="module")
def offline(demo_model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(demo_model_dir), num_kv_blocks=512))


def ask(server: LiveServer, messages: list[dict[str, Any]], max_tokens: int = 8) -> Any:
    return server.client(timeout=120).chat.completions.create(
        model="demo", messages=messages, max_tokens=max_tokens, temperature=0  # type: ignore[arg-type]
    )


def offline_text(engine: Engine, text: str, images: list[bytes], max_tokens: int) -> str:
    parts: list[dict[str, Any]] = [{"type": "image", "image": Image.open(io.BytesIO(b)).convert("RGB")} for b in images]
    parts.append({"type": "text", "text": text})
    [out] = engine.generate([[{"role": "user", "content": parts}]], SamplingParams(max_tokens=max_tokens, temperature=0))
    return out.text


def replicas(server: LiveServer) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = server.stats()["replicas"]
    return rows


def test_answers_are_token_exact_with_one_engine(dp2: LiveServer, offline: Engine) -> None:
    cases = [
        ("Describe both pages.", [png_bytes(300, 200, seed=101), png_bytes(123, 77, seed=102)]),
        ("What is this?", [png_bytes(64, 250, seed=103)]),
        ("Say something about glimpse.", []),
        ("Compare.", [png_bytes(200, 120, seed=104), png_bytes(90, 90, seed=105)]),
    ]
    before = [r["routed"] for r in replicas(dp2)]
    for text, images in cases:
        resp = ask(dp2, image_message(text, [data_url(b) for b in images]), max_tokens=10)
        assert resp.choices[0].message.content == offline_text(offline, text, images, 10), text
    after = [r["routed"] for r in replicas(dp2)]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)  # both replicas answered


def test_a_chat_stays_with_its_images_while_unrelated_load_spreads(dp2: LiveServer) -> None:
    start = dp2.stats()
    routed0 = [r["routed"] for r in start["replicas"]]
    unrelated = [png_bytes(96 + i, 80, seed=300 + i) for i in range(8)]

    def other(i: int) -> None:
        ask(dp2, image_message(f"Unrelated {i}.", [data_url(unrelated[i])]), max_tokens=4)

    chat_images = [data_url(png_bytes(300, 200, seed=201)), data_url(png_bytes(200, 300, seed=202))]
    messages: list[dict[str, Any]] = image_message("Here are two pages.", chat_images)
    cached: list[int] = []
    with ThreadPoolExecutor(2) as pool:
        load = [pool.submit(other, i) for i in range(len(unrelated))]
        for turn in range(4):
            resp = ask(dp2, messages, max_tokens=6)
            cached.append(resp.usage.prompt_tokens_details.cached_tokens)
            messages += [{"role": "assistant", "content": resp.choices[0].message.content},
                         {"role": "user", "content": f"And on turn {turn + 2}?"}]
        for f in load:
            f.result()
    end = dp2.stats()
    # Every image encoded once: the chat's two on turn 1, never again on turns 2-4 (they found their
    # replica's embeddings and KV blocks), and each unrelated one once.
    assert end["images_encoded"] - start["images_encoded"] == len(chat_images) + len(unrelated)
    assert cached[0] < 150 and all(c >= 150 for c in cached[1:]), cached  # the images' blocks came from cache
    spread = [r["routed"] - r0 for r, r0 in zip(end["replicas"], routed0, strict=True)]
    assert min(spread) >= 2 and sum(spread) == 4 + len(unrelated), spread
    assert sum(r["routed_by_affinity"] for r in end["replicas"]) >= 3


def rendered(processor: MMProcessor, text: str, images: list[bytes]) -> tuple[list[int], list[tuple[str, int, int]]]:
    """The chat as a vLLM-style render gives it to a router: tokens with the real image token id in each image's
    span, and per image its identifier (no uuid given: glimpse's media hash, docs/kv-events.md) and range."""
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    parts: list[dict[str, Any]] = [{"type": "image", "image": im} for im in pil]
    parts.append({"type": "text", "text": text})
    prompt = processor.build(processor.render([{"role": "user", "content": parts}]), [processor.process_image(im) for im in pil])
    tokens = list(prompt.input_ids)
    media = []
    for span, raw in zip(prompt.spans, images, strict=True):
        tokens[span.offset : span.offset + span.length] = [processor.info.image_token_id] * span.length
        media.append((processor.media_hash(raw).hex(), span.offset, span.length))
    return tokens, media


def test_kv_events_key_image_chats_as_llm_d_does_on_one_stream(dp2: LiveServer, events: EventLog, demo_model_dir: Path) -> None:
    processor = MMProcessor(demo_model_dir)
    text, raws = "Two new pages.", [png_bytes(280, 140, seed=401), png_bytes(140, 280, seed=402)]
    ask(dp2, image_message(text, [data_url(b) for b in raws]), max_tokens=4)
    tokens, media = rendered(processor, text, raws)
    index = Index(block_size=16, model="demo")  # the topic's model; llm-d's blockSizeTokens = glimpse's block size
    keys = index.request_keys(tokens, media)
    assert len(keys) >= 6 and all(m[2] > 16 for m in media)  # blocks inside and across both images
    # What llm-d's token producer does: glimpse's own render route keys the request the same way.
    body = {"model": "demo", "messages": image_message(text, [data_url(b) for b in raws])}
    got = httpx.post(dp2.base + "/v1/chat/completions/render", json=body, timeout=60)
    assert got.status_code == 200, got.text
    features = got.json()["features"]
    placed = zip(features["mm_hashes"]["image"], features["mm_placeholders"]["image"], strict=True)
    assert index.request_keys(got.json()["token_ids"], [(h, p["offset"], p["length"]) for h, p in placed]) == keys

    def matched() -> list[bool]:
        index.by_engine.clear()
        index.keys.clear()
        for _, evs, _ in events.batches():
            for ev in evs:
                index.apply(ev)
        return [k in index.keys for k in keys]

    deadline = time.monotonic() + 10
    while not all(matched()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(matched()), matched()  # every block of the chat, images included

    # Both replicas on one stream: one topic (llm-d's kv@<address>:<port>@<model>), one consecutive sequence.
    assert {t for t, _, _ in events.frames} == {f"kv@127.0.0.1:{dp2.port}@demo".encode()}
    seqs = [seq for _, seq, _ in list(events.frames)]
    assert seqs == list(range(len(seqs)))
    assert {rank for _, _, rank in events.batches()} == {0, 1}
    ours = {h for ev in events.events() if ev["type"] == "BlockStored" for h in ev["block_hashes"]}

    # A subscriber that lost batches asks the replay socket for them: the same frames, topic and all.
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{events.replay_port}")
    try:
        start = len(seqs) // 2
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while dealer.poll(10_000):
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append((topic, int.from_bytes(seq, "big"), payload))
        assert replayed[: len(seqs) - start] == events.frames[start : len(seqs)]
    finally:
        dealer.close(linger=0)
        ctx.term()

    # Fill both replicas' caches with other prompts: the request's blocks are recycled and announced.
    words = " ".join(f"w{i}" for i in range(100))  # ~25 blocks a prompt: 10 of them overflow 2 x 64
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: ask(dp2, [{"role": "user", "content": f"{i} {words}"}], max_tokens=2), range(10)))

    def removed() -> set[int]:
        return {h for ev in events.events() if ev["type"] == "BlockRemoved" for h in ev["block_hashes"]}

    deadline = time.monotonic() + 10
    while not (ours & removed()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ours & removed()
    assert external_hash(b"\x00" * 8 + b"\xff" * 8) == 0  # the first 8 bytes of the key, big-endian


def test_metrics_carry_the_gateway_gauges_per_replica_and_in_total(dp2: LiveServer) -> None:
    text = httpx.get(dp2.base + "/metrics", timeout=10).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    names = {name for name, _ in samples}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info"):
        assert name in names, name
    usage = samples[("vllm:kv_cache_usage_perc", (("model_name", "demo"),))]
    assert 0.0 <= usage <= 1.0
    lora_labels = (("max_lora", "0"), ("running_lora_adapters", ""), ("waiting_lora_adapters", ""))
    assert ("vllm:lora_requests_info", lora_labels) in samples
    config = (("block_size", "16"), ("cache_dtype", "float32"), ("num_gpu_blocks", str(2 * KV_BLOCKS)))
    assert samples[("vllm:cache_config_info", config)] == 1
    stats = dp2.stats()
    rows = stats["replicas"]
    assert [r["replica"] for r in rows] == [0, 1]
    assert sum(r["kv_blocks"]["total"] for r in rows) == stats["kv_blocks"]["total"] == 2 * KV_BLOCKS
    assert sum(r["images_encoded"] for r in rows) == stats["images_encoded"]
    for r in rows:
        key = ("glimpse_replica_images_encoded_total", (("replica", str(r["replica"])),))
        assert samples[key] == r["images_encoded"]
    # /health stays the readiness probe: 200 now (503 while starting or draining).
    assert httpx.get(dp2.base + "/health").json() == {"status": "ok"}


def test_one_image_on_both_replicas_has_a_name_on_each(dp2: LiveServer, demo_model_dir: Path) -> None:
    raw = png_bytes(56, 56, seed=601)  # a few tokens: no reason to steer a long prompt to where it is
    digest = MMProcessor(demo_model_dir).media_hash(raw).hex()
    words = " ".join(f"v{i}" for i in range(60))
    before = [r["images_encoded"] for r in replicas(dp2)]
    for i in range(2):  # one after another: the idle replicas take turns
        ask(dp2, image_message(f"{i} {words}", [data_url(raw)]), max_tokens=2)
    assert [r["images_encoded"] - b for r, b in zip(replicas(dp2), before, strict=True)] == [1, 1]
    # The second replica's request linked the first one's segment (no second write); each replica keeps
    # its own name for the chat's next turn and will unlink only that one.
    names = [n for n in dp2.segments() if digest in n]
    assert len(names) == 2
    assert len({os.stat(f"/dev/shm/{n}").st_ino for n in names}) == 1
    ask(dp2, image_message("again", [data_url(raw)]), max_tokens=2)  # still served from a live name


def test_a_render_is_answered_by_the_tokenizer_and_routed_nowhere(dp2: LiveServer, demo_model_dir: Path) -> None:
    """With --dp a render still goes no further than a tokenizer: no replica is chosen, none counts it."""
    raw = png_bytes(48, 40, seed=31)
    before = [(r["routed"], r["requests"]) for r in replicas(dp2)]
    body = {"model": "demo", "messages": image_message("Which replica?", [data_url(raw)])}
    got = httpx.post(dp2.base + "/v1/chat/completions/render", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["features"]["mm_hashes"] == {"image": [MMProcessor(demo_model_dir).media_hash(raw).hex()]}
    time.sleep(0.6)  # the replicas' counters arrive every 0.25 s
    assert [(r["routed"], r["requests"]) for r in replicas(dp2)] == before


def test_a_replica_killed_under_load_fails_its_requests_fast_and_leaves_no_shm(dp2: LiveServer) -> None:
    [victim] = dp2.child_pids("model[1]")
    children = dp2.child_pids("scheduler") + dp2.child_pids("model")
    codes: list[int] = []
    ended: list[float] = []

    def load(worker: int) -> None:
        """Requests back to back until one fails: there is always one in flight when the replica dies."""
        for i in range(1000):
            body = {"model": "demo", "max_tokens": 32, "messages": image_message(
                f"Load {worker}/{i}.", [data_url(png_bytes(150 + worker, 100, seed=500 + 1000 * worker + i))])}
            try:
                codes.append(httpx.post(dp2.base + "/v1/chat/completions", json=body, timeout=30).status_code)
            except httpx.HTTPError:
                codes.append(-1)  # the server went away mid-answer: also an end, not a hang
            if codes[-1] != 200:
                break
        ended.append(time.monotonic())

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(load, w) for w in range(4)]
        deadline = time.monotonic() + 60
        while len(codes) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        for f in futures:
            f.result(timeout=30)
    dp2.crashed = True
    assert max(ended) - killed < 10, "requests hung after the replica died"
    assert dp2.proc.wait(15) != 0
    failed = [c for c in codes if c != 200]
    assert len(failed) == 4 and set(failed) <= {503, -1} and 503 in failed, codes
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in children)  # no replica left behind
    assert dp2.segments() == []
    assert "model[1]" in dp2.output() and "SIGKILL" in dp2.output()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
