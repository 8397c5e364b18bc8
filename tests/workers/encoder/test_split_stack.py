"""A scheduler, a model worker and an encoder worker as real spawned processes (process_stack.py's harness; the
test plays frontend and tokenizer): tokens equal the offline engine's, an image the encoder cannot encode fails its
own request with a 400 while the others go on, and a request aborted while its image is being encoded keeps its
pixels until the encoder is done with them, then leaves nothing in /dev/shm. A landed entry counts in the shm budget
(and the stats) until the step that imports it is over; the model worker holds no vision weights."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from ipc.control import AbortRequest
from ipc.shm import ShmSegment, list_segments, segment_name, sweep
from ipc.stats import SchedulerStats
from tests.conftest import noise_image
from tests.workers.scheduler.process_stack import (
    GREEDY,
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


@pytest.fixture(scope="module")
def processor(demo_model_dir: Path) -> MMProcessor:
    return MMProcessor(demo_model_dir)


@pytest.fixture(scope="module")
def stack(demo_model_dir: Path, processor: MMProcessor) -> Iterator[Stack]:
    stack = start_stack(demo_model_dir, processor, encoder_workers=1)
    yield stack
    if all(proc.is_alive() for proc in stack.procs):
        stop_stack(stack)


@pytest.fixture(autouse=True)
def no_leftover_segments(stack: Stack) -> Iterator[None]:
    yield
    lid = stack.config.launch_id
    leftover = list_segments(lid) if not wait_for(lambda: not list_segments(lid), 10) else []
    sweep(lid)
    assert leftover == []


def test_two_images_stream_the_offline_engine_tokens(stack: Stack, demo_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(demo_model_dir), max_model_len=4096, num_kv_blocks=256))
    messages = chat("Compare these two pictures.", TWO_IMAGES)
    [expected] = engine.generate([messages], GREEDY)
    stack.to_sched.send(stack.request("two", messages))
    outputs, failed = stack.collect({"two"})
    assert not failed
    assert [t for out in outputs["two"] for t in out.token_ids] == expected.token_ids


def test_an_image_the_encoder_cannot_encode_fails_only_its_request(stack: Stack) -> None:
    good = stack.request("good", chat("A fine picture.", [noise_image(90, 60, seed=3)]))
    bad = stack.request("bad", chat("A broken one.", [noise_image(80, 64, seed=4)]))
    # Its segment holds half the rows its grid needs (what a corrupt write would leave).
    [item] = bad.items
    assert item.pixels is not None
    with ShmSegment.attach(item.pixels) as seg:
        rows = seg.tensor(item.pixels).clone()
    half = rows[: rows.shape[0] // 2]
    name = segment_name(stack.config.launch_id, f"{item.hash.hex()}-half")
    ShmSegment.create_from_tensor(name, half)[0].close()
    ShmSegment.unlink(item.pixels.name)
    bad = msgspec.structs.replace(
        bad, items=[msgspec.structs.replace(item, pixels=shm_ref(name, half))], shm_names=[name],
        shm_bytes=half.nbytes,
    )
    stack.to_sched.send(bad)
    stack.to_sched.send(good)
    outputs, failed = stack.collect({"good", "bad"})
    assert set(failed) == {"bad"} and failed["bad"].status == 400 and "grid" in failed["bad"].message
    assert outputs["good"][-1].finish_reason is not None


def test_an_abort_while_encoding_keeps_the_pixels_until_the_encoder_is_done(stack: Stack) -> None:
    encoder = stack.procs[1]
    assert encoder.pid is not None
    req = stack.request("aborted", chat("Never mind.", [noise_image(100, 70, seed=5)]))
    [name] = req.shm_names
    os.kill(encoder.pid, signal.SIGSTOP)
    try:
        stack.to_sched.send(req)
        # Admitted (its encode sent, the text before the image computed) before the abort.
        while not (isinstance(msg := stack.recv(), SchedulerStats) and msg.requests_running):
            pass
        stack.to_sched.send(AbortRequest("aborted"))
        stack.to_sched.send(stack.request("next", [{"role": "user", "content": "hi"}], GREEDY))
        outputs, failed = stack.collect({"next"})
        assert not failed and exists(name)  # the encoder (stopped) may still map it: not unlinked yet
    finally:
        os.kill(encoder.pid, signal.SIGCONT)
    # Its answer comes back: the pixels go, and so does the landing segment nobody will import.
    assert wait_for(lambda: not list_segments(stack.config.launch_id), 20), list_segments(stack.config.launch_id)


def _stats_until(stack: Stack, cond: Callable[[SchedulerStats], bool]) -> SchedulerStats:
    """The first scheduler stats (every 0.25 s) that satisfy ``cond``."""
    while not (isinstance(msg := stack.recv(), SchedulerStats) and cond(msg)):
        pass
    return msg


def test_a_landed_entry_counts_in_the_shm_budget_until_its_step_is_over(stack: Stack) -> None:
    model = stack.procs[0]
    assert model.pid is not None
    req = stack.request("landed", chat("What is this?", [noise_image(96, 64, seed=6)]))
    # The model worker stopped: the first step (the text before the image) never comes back, so the entry the
    # encoder lands meanwhile stays in its landing segment, imported by a step not yet over.
    os.kill(model.pid, signal.SIGSTOP)
    try:
        stack.to_sched.send(req)
        landed = _stats_until(stack, lambda s: s.shm_landing_segments == 1)
        [item] = req.items
        width = stack.config.engine.model_spec().embed_width
        assert landed.shm_landing_bytes == item.length * width * 4  # float32 rows on the CPU
        assert landed.shm_bytes == req.shm_bytes + landed.shm_landing_bytes  # pixels and landing: one budget
        assert len([n for n in list_segments(stack.config.launch_id) if "emb-" in n]) == 1
    finally:
        os.kill(model.pid, signal.SIGCONT)
    outputs, failed = stack.collect({"landed"})
    assert not failed and outputs["landed"][-1].finish_reason is not None
    drained = _stats_until(stack, lambda s: not s.requests_running and not s.shm_landing_bytes and not s.shm_bytes)
    assert drained.shm_landing_segments == 0
    # The model worker built no tower: encoder workers run it.
    [worker] = drained.workers
    assert worker.vision_weight_bytes == 0 and worker.weight_bytes > 0 and worker.images_encoded == 0
