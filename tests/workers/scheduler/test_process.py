"""The scheduler and a model worker as real spawned processes, over real ZMQ sockets and real shm.

The test process plays the frontend (PULL bound at ``frontend``) and a tokenizer (PUSH to ``sched``,
PULL bound at ``tok0`` for the scheduler's stats): it builds TokenizedRequests with the engine's
MMProcessor and writes pixels to shm itself, the way the tokenizer worker does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from ipc.control import AbortRequest, RequestFailed
from ipc.launch import new_launch_id
from ipc.outputs import OutputBatch
from ipc.prompts import MediaFailed, MediaReady, MMItem, TokenizedRequest
from ipc.shm import SHM_DIR, ShmSegment, list_segments, segment_name, sweep
from ipc.stats import SchedulerStats
from ipc.steps import StepResult
from server.config import ServerConfig
from tests.conftest import noise_image
from tests.workers.scheduler.process_stack import (
    GREEDY,
    LONG,
    SHM_BUDGET,
    SHORT,
    TWO_IMAGES,
    Stack,
    chat,
    exists,
    shm_ref,
    start_stack,
    stop_stack,
    wait_for,
)
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine
from workers.engine.prompt.processor import MMProcessor
from workers.scheduler.process import build_core


@pytest.fixture(scope="module")
def processor(demo_model_dir: Path) -> MMProcessor:
    return MMProcessor(demo_model_dir)


@pytest.fixture(scope="module")
def engine(demo_model_dir: Path) -> Engine:
    """The offline engine with the same settings: the reference for the served tokens."""
    return Engine(EngineConfig(model=str(demo_model_dir), max_model_len=4096, num_kv_blocks=256))


@pytest.fixture(scope="module")
def stack(demo_model_dir: Path, processor: MMProcessor) -> Iterator[Stack]:
    stack = start_stack(demo_model_dir, processor)
    yield stack
    if all(proc.is_alive() for proc in stack.procs):
        stop_stack(stack)


@pytest.fixture(autouse=True)
def no_leftover_segments(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    stack = request.node.funcargs.get("stack")
    if isinstance(stack, Stack):
        lid = stack.config.launch_id
        # The scheduler unlinks; give an abort that is still being processed a moment.
        leftover = list_segments(lid) if not wait_for(lambda: not list_segments(lid), 10) else []
        sweep(lid)
        assert leftover == []


def test_two_images_stream_the_offline_engine_tokens(stack: Stack, engine: Engine) -> None:
    messages = chat("Compare these two pictures.", TWO_IMAGES)
    [expected] = engine.generate([messages], GREEDY)
    req = stack.request("two", messages)
    assert len(req.items) == 2 and all(exists(n) for n in req.shm_names)
    stack.to_sched.send(req)
    outputs, failed = stack.collect({"two"})
    assert failed == {}
    outs = outputs["two"]
    assert [t for o in outs for t in o.token_ids] == expected.token_ids
    assert "".join(o.text for o in outs) == stack.processor.decode(expected.token_ids) == expected.text
    assert outs[-1].finish_reason == expected.finish_reason
    assert [o.finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)
    n = len(expected.token_ids)
    assert outs[-1].prompt_tokens == len(req.input_ids) and outs[-1].completion_tokens == n
    # The scheduler unlinked the request's names before it sent the last output.
    assert not any(exists(n) for n in req.shm_names)
    # Stats reach the frontend and the tokenizer (shm pressure) with the step's work in them.
    while not any(s.generated_tokens >= n and s.requests_running == 0 for s in stack.stats):
        stack.recv(5.0)
    latest = stack.stats[-1]
    assert latest.steps >= n and latest.images_encoded >= 2 and latest.vit_batches >= 1
    # Asynchronous scheduling: every decode after the prefill's token went out while the step before it ran.
    assert latest.steps_ahead >= n - 1
    assert latest.mm_cache_entries >= 2 and latest.mm_cache_misses >= 2
    assert latest.prompt_tokens >= len(req.input_ids)
    assert latest.kv_blocks_total == 256 and latest.kv_blocks_used == 0 and latest.requests_waiting == 0
    assert latest.shm_segments == 0 and latest.shm_bytes == 0 and latest.shm_budget_bytes == SHM_BUDGET
    tok_stats = stack.tok.recv(5_000)
    assert isinstance(tok_stats, SchedulerStats) and tok_stats.shm_budget_bytes == SHM_BUDGET


def test_without_async_scheduling_every_step_waits_for_the_last(demo_model_dir: Path, processor: MMProcessor) -> None:
    stack = start_stack(demo_model_dir, processor, async_scheduling=False)
    try:
        messages = [{"role": "user", "content": "Count the sheep."}]
        stack.to_sched.send(stack.request("sync", messages))
        outputs, failed = stack.collect({"sync"})
        assert failed == {} and len([t for o in outputs["sync"] for t in o.token_ids]) >= 1
        while not any(s.requests_running == 0 and s.steps >= 2 for s in stack.stats):
            stack.recv(5.0)
        assert stack.stats[-1].steps_ahead == 0
    finally:
        stop_stack(stack)


def test_stop_string_spanning_tokens(stack: Stack, engine: Engine) -> None:
    messages = chat("Describe the second picture.", TWO_IMAGES[::-1])
    [expected] = engine.generate([messages], GREEDY)
    text = expected.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    stack.to_sched.send(stack.request("stop", messages, msgspec.structs.replace(GREEDY, stop=(stop,))))
    outputs, _ = stack.collect({"stop"})
    outs = outputs["stop"]
    assert "".join(o.text for o in outs) == text[:cut]
    assert outs[-1].finish_reason == "stop"
    got = [t for o in outs for t in o.token_ids]
    assert got == expected.token_ids[: len(got)] and len(got) < len(expected.token_ids)


def test_abort_mid_generation(stack: Stack) -> None:
    req = stack.request("long", chat("Tell a long story.", TWO_IMAGES), LONG)
    stack.to_sched.send(req)
    while True:
        msg = stack.recv()
        if isinstance(msg, OutputBatch) and any(o.rid == "long" for o in msg.outputs):
            break
    stack.to_sched.send(AbortRequest("long"))
    assert wait_for(lambda: not any(exists(n) for n in req.shm_names))
    # The names go when the abort is applied. Outputs the scheduler sent before that may still sit in
    # our socket; anything it sends after follows a request we send now, so after that request's first
    # output nothing more may come for the aborted one.
    stack.to_sched.send(stack.request("after-abort", [{"role": "user", "content": "hi"}], SHORT))
    seen_after = done = False
    while not done:
        msg = stack.recv()
        assert not (isinstance(msg, RequestFailed) and msg.rid == "long")
        if isinstance(msg, OutputBatch):
            for out in msg.outputs:
                assert not (out.rid == "long" and seen_after), "output for an aborted request"
                if out.rid == "after-abort":
                    seen_after = True
                    done = out.finish_reason is not None


def test_abort_before_the_request_arrives(stack: Stack) -> None:
    early = stack.request("early", chat("Never served.", TWO_IMAGES[:1]))
    stack.to_sched.send(AbortRequest("early"))
    stack.to_sched.send(early)
    stack.to_sched.send(stack.request("after", [{"role": "user", "content": "hi"}], SHORT))
    outputs, failed = stack.collect({"after"})
    assert set(outputs) == {"after"} and failed == {}
    assert not any(exists(n) for n in early.shm_names)


def _pending(req: TokenizedRequest, index: int) -> tuple[TokenizedRequest, str, str]:
    """``req`` with image ``index`` still being written, as the tokenizer sends it with overlap: the segment is
    moved to a side name (the tokenizer's temporary one) until the test "publishes" it again."""
    item = req.items[index]
    assert item.pixels is not None
    final, side = os.path.join(SHM_DIR, item.pixels.name), os.path.join(SHM_DIR, item.pixels.name + "-tmp")
    os.rename(final, side)
    return msgspec.structs.replace(req, pending=[item.hash]), side, final


def test_prefill_waits_for_an_image_still_being_written(stack: Stack, engine: Engine) -> None:
    """Overlap of preprocessing and prefill, scheduler side: a chunk never reaches an image whose segment is not
    published (a model worker reading it would fail the step), the tokens equal the offline engine's once it is;
    an aborted request's name published later is unlinked on its MediaReady; MediaFailed drops a request quietly."""
    messages = chat("Compare these two pictures.", TWO_IMAGES)
    [expected] = engine.generate([messages], GREEDY)
    req, side, final = _pending(stack.request("pend", messages), 1)
    stack.to_sched.send(req)
    time.sleep(0.5)  # the steps up to the second image run meanwhile
    os.rename(side, final)
    stack.to_sched.send(MediaReady("pend", [req.items[1].hash]))
    outputs, failed = stack.collect({"pend"})
    assert failed == {} and [t for o in outputs["pend"] for t in o.token_ids] == expected.token_ids

    orphan, side, final = _pending(stack.request("orphan", chat("Never served.", TWO_IMAGES[:1]), LONG), 0)
    stack.to_sched.send(orphan)
    stack.to_sched.send(AbortRequest("orphan"))
    stack.to_sched.send(stack.request("between", [{"role": "user", "content": "hi"}], SHORT))
    stack.collect({"between"})
    os.rename(side, final)  # published after its request ended
    stack.to_sched.send(MediaReady("orphan", [orphan.items[0].hash]))
    assert wait_for(lambda: not exists(os.path.basename(final)))

    dropped, side, _ = _pending(stack.request("dropped", chat("Compare these two pictures.", TWO_IMAGES), LONG), 1)
    stack.to_sched.send(dropped)
    os.unlink(side)  # the tokenizer's part: stop writing, unlink what it never reported
    stack.to_sched.send(MediaFailed("dropped"))
    stack.to_sched.send(stack.request("last", [{"role": "user", "content": "hi"}], SHORT))
    outputs, failed = stack.collect({"last"})
    assert set(outputs) == {"last"} and failed == {}  # nothing, not even a failure, for the dropped request
    assert wait_for(lambda: not any(exists(n) for n in dropped.shm_names))


def test_shm_budget_and_rejections(stack: Stack) -> None:
    big = [noise_image(640, 480, seed=10 + i) for i in range(3)]  # 4.2 MB of float32 pixels each
    holder = stack.request("holder", chat("Keep this one busy.", big[:1]), LONG)
    stack.to_sched.send(holder)
    # Two more distinct images on top of the live one go past the 10 MiB budget: 503, names unlinked.
    over = stack.request("over", chat("Too much.", big[1:]))
    stack.to_sched.send(over)
    # The live image again (a hard link, the tokenizer's reuse path) adds no bytes: accepted.
    reuse = {holder.items[0].hash: holder.shm_names[0]}
    again = stack.request("again", chat("Same picture.", big[:1]), SHORT, reuse=reuse)
    stack.to_sched.send(again)
    # Longer than max_model_len: 400.
    n = 5000
    stack.to_sched.send(TokenizedRequest("huge", [100] * n, 0, [], GREEDY, [], 0))
    outputs, failed = stack.collect({"over", "again", "huge"})
    assert failed["over"].status == 503 and failed["over"].code == "shm_budget_exceeded"
    assert failed["over"].type == "server_error"
    assert not any(exists(name) for name in over.shm_names)
    assert outputs["again"][-1].finish_reason is not None and "again" not in failed
    assert not exists(again.shm_names[0]) and exists(holder.shm_names[0])
    assert failed["huge"].status == 400 and failed["huge"].code == "context_length_exceeded"
    stack.to_sched.send(AbortRequest("holder"))
    assert wait_for(lambda: not exists(holder.shm_names[0]))


def test_a_failed_step_fails_its_requests_and_the_worker_keeps_serving(stack: Stack, engine: Engine) -> None:
    messages = chat("What is this?", [noise_image(200, 150, seed=77)])
    broken = stack.request("broken", messages)
    for name in broken.shm_names:
        ShmSegment.unlink(name)  # the pixels vanish: the worker's read fails inside the step
    stack.to_sched.send(broken)
    _, failed = stack.collect({"broken"})
    assert failed["broken"].status == 500 and failed["broken"].type == "server_error"
    assert "FileNotFoundError" in failed["broken"].message
    # Same image again: the index must not believe the failed step cached it, so it is encoded now.
    [expected] = engine.generate([messages], GREEDY)
    stack.to_sched.send(stack.request("fixed", messages))
    outputs, failed = stack.collect({"fixed"})
    assert failed == {} and [t for o in outputs["fixed"] for t in o.token_ids] == expected.token_ids


def test_plan_bytes_do_not_grow_with_pixels(demo_model_dir: Path, processor: MMProcessor) -> None:
    """Plans carry pointers: for 16 images at two sizes, the encode part of the plan is the same size
    and the whole plan stays a few bytes per prompt token, while the pixels differ by megabytes."""
    engine = EngineConfig(str(demo_model_dir), max_model_len=65536, num_kv_blocks=8192, chunk_size=65536)
    config = ServerConfig(engine, new_launch_id(), "demo")
    encode = msgspec.msgpack.Encoder().encode
    sizes: dict[int, dict[str, int]] = {}
    for side in (300, 1000):
        images = [noise_image(side, side, seed=100 + i) for i in range(16)]
        processed = [processor.process_image(img) for img in images]
        prompt = processor.build(processor.render(chat("Sixteen pages.", images)), processed)
        names = {
            p.hash: segment_name(config.launch_id, f"{p.hash.hex()}-{i}") for i, p in enumerate(processed)
        }
        refs = {p.hash: shm_ref(names[p.hash], p.pixel_values) for p in processed}
        items = [MMItem(s.hash, s.offset, s.length, s.grid, refs[s.hash]) for s in prompt.spans]
        core = build_core(config, 8192)
        core.add("r", prompt.input_ids, prompt.mrope_delta, items, GREEDY)
        first = core.schedule()
        assert first is not None and len(first.encode) == 16 and first.chunks[0].sample
        core.update(StepResult(first.step_id, [("r", 7)]))
        decode = core.schedule()
        assert decode is not None
        sizes[side] = {
            "plan": len(encode(first)),
            "encode": len(encode(first.encode)),
            "decode": len(encode(decode)),
            "tokens": len(prompt.input_ids),
            "pixels": sum(p.pixel_values.nbytes for p in processed),
        }
    small, big = sizes[300], sizes[1000]
    assert big["pixels"] > 2 * small["pixels"]  # the demo processor caps images at ~200k pixels
    # Per image: hash, grid, token count and a ShmRef (name, nbytes, dtype, shape), under 220 bytes (the
    # segment name carries the launch id, which names the launcher's pid and pid namespace);
    # only the msgpack width of an integer may differ (e.g. 121 vs 256 tokens: 1 vs 3 bytes).
    assert small["encode"] < 16 * 220 and abs(big["encode"] - small["encode"]) <= 16 * 4
    assert abs(big["decode"] - small["decode"]) <= 4
    for m in (small, big):
        # ids + 3 position rows per prompt token, nothing per pixel.
        assert m["plan"] / m["tokens"] < 24 and m["plan"] < m["pixels"] / 500


def test_shutdown_with_a_live_request(demo_model_dir: Path, processor: MMProcessor) -> None:
    stack = start_stack(demo_model_dir, processor)
    req = stack.request("live", chat("Keep going.", TWO_IMAGES), LONG)
    stack.to_sched.send(req)
    while not isinstance(stack.recv(), OutputBatch):
        pass
    assert all(exists(n) for n in req.shm_names)
    # The scheduler unlinks the live request's names itself and stops the model worker.
    stop_stack(stack)
    assert not any(exists(n) for n in req.shm_names)
