"""An encoder worker as a real spawned process over real ZMQ sockets and real shm: the test plays its scheduler.

Its landing segment holds exactly the entry the model worker's own tower computes (Qwen2.5-VL; Qwen3-VL with its
DeepStack levels side by side), a batch with one bad image fails only that image's request (400), and Shutdown ends
it cleanly with nothing of the launch left in /dev/shm once the scheduler's part (unlinking) is done."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from ipc import endpoints
from ipc.channels import PullSocket, PushSocket, new_context
from ipc.control import ProcessReady, Shutdown
from ipc.encode import EncodeDone, EncodeFailed, EncodeRequest
from ipc.inbound import EncoderInbound, SchedulerInbound
from ipc.shm import ShmRef, ShmSegment, segment_name
from ipc.stats import EncoderStats
from ipc.steps import EncodeItem
from server.config import ServerConfig
from tests.conftest import noise_image
from workers.encoder.process import answer_groups, run_encoder_worker
from workers.engine.config import EngineConfig
from workers.engine.models import family, load_spec
from workers.engine.models.load import load_model
from workers.engine.prompt.media_items import ProcessedImage
from workers.engine.prompt.processor import MMProcessor
from workers.engine.runner.batching import pixel_rows

TIMEOUT_MS = 120_000


class FakeScheduler:
    """The scheduler's side of one encoder worker: its PULL socket (replica ``replica``'s) and a PUSH to the encoder."""

    def __init__(self, config: ServerConfig, replica: int = 0) -> None:
        self.ctx = new_context()
        self.inbound: PullSocket[SchedulerInbound] = endpoints.pull(self.ctx, config.launch_id, endpoints.SCHEDULER,
                                                                    replica)
        self.to_encoder: PushSocket[EncoderInbound] = endpoints.push(self.ctx, config.launch_id, endpoints.ENCODER)
        self.stats: list[EncoderStats] = []

    def recv(self) -> SchedulerInbound:
        while True:
            msg = self.inbound.recv(TIMEOUT_MS)
            assert msg is not None, "nothing from the encoder in time"
            if isinstance(msg, EncoderStats):
                self.stats.append(msg)
                continue
            return msg

    def answers(self, n: int) -> dict[bytes, EncodeDone | EncodeFailed]:
        out: dict[bytes, EncodeDone | EncodeFailed] = {}
        while len(out) < n:
            msg = self.recv()
            assert isinstance(msg, EncodeDone | EncodeFailed), msg
            out[msg.key] = msg
        return out

    def latest_stats(self, jobs: int) -> EncoderStats:
        """The encoder's counters once they count ``jobs`` answers (they follow each batch's answers)."""
        while not self.stats or self.stats[-1].jobs + self.stats[-1].failed < jobs:
            msg = self.inbound.recv(TIMEOUT_MS)
            assert isinstance(msg, EncoderStats), msg
            self.stats.append(msg)
        return self.stats[-1]

    def close(self) -> None:
        self.inbound.close()
        self.to_encoder.close(linger_ms=1000)
        self.ctx.term()


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    fixture = "demo_model_dir" if request.param == "qwen2_5_vl" else "qwen3_model_dir"
    path: Path = request.getfixturevalue(fixture)
    return path


@pytest.fixture
def encoder(model_dir: Path, launch_id: str) -> Iterator[tuple[ServerConfig, FakeScheduler]]:
    engine = EngineConfig(model=str(model_dir), spec=load_spec(model_dir))
    config = ServerConfig(engine, launch_id, "demo", encoder_workers=1, log_level="warning")
    with running_encoder(config) as sched:
        yield config, sched


@contextmanager
def running_encoder(config: ServerConfig) -> Iterator[FakeScheduler]:
    """Encoder worker 0 of ``config`` spawned and ready, with the test as its scheduler; a clean Shutdown after."""
    sched = FakeScheduler(config)
    proc = multiprocessing.get_context("spawn").Process(target=run_encoder_worker, args=(config, 0), daemon=True)
    proc.start()
    try:
        ready = sched.recv()
        assert isinstance(ready, ProcessReady) and ready.role == "encoder" and ready.pid == proc.pid
        yield sched
        sched.to_encoder.send(Shutdown("test over"))
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        sched.close()


def write_pixels(launch_id: str, image: ProcessedImage, grid: tuple[int, int, int] | None = None) -> EncodeItem:
    name = segment_name(launch_id, f"{image.hash.hex()}-{time.monotonic_ns():x}")
    seg, ref = ShmSegment.create_from_tensor(name, image.pixel_values)
    seg.close()
    return EncodeItem(image.hash, grid or image.grid, image.num_tokens, ref)


def landed(ref: ShmRef) -> torch.Tensor:
    """The landing segment's entry, copied out and unlinked (the scheduler's part)."""
    with ShmSegment.attach(ref) as seg:
        out = seg.tensor(ref).clone()
    ShmSegment.unlink(ref.name)
    return out


def reference(model_dir: Path, images: list[ProcessedImage]) -> list[torch.Tensor]:
    """What a model worker's tower stores: the whole model loaded, its encode called on the rows."""
    spec = load_spec(model_dir)
    from workers.engine.layers.linear import TPGroup

    model = load_model(family(spec.family).build(spec, TPGroup(), torch.float32, torch.device("cpu"), "auto"), model_dir)
    with torch.inference_mode():
        return [model.encode(pixel_rows([im.pixel_values], torch.device("cpu"), torch.float32, None), [im.grid])
                for im in images]


def test_entries_equal_the_model_workers_tower(model_dir: Path, encoder: tuple[ServerConfig, Any]) -> None:
    config, sched = encoder
    processor = MMProcessor(model_dir)
    images = [processor.process_image(noise_image(w, h, seed=i)) for i, (w, h) in enumerate([(300, 200), (57, 83)])]
    items = [write_pixels(config.launch_id, im) for im in images]
    answers: dict[bytes, EncodeDone | EncodeFailed] = {}
    for item in items:  # one at a time: one ViT call each, as the reference runs them (a batch differs in its last bits)
        sched.to_encoder.send(EncodeRequest(item.hash, [item]))
        answers.update(sched.answers(1))
    expected = reference(model_dir, images)
    spec = load_spec(model_dir)
    for image, want in zip(images, expected, strict=True):
        done = answers[image.hash]
        assert isinstance(done, EncodeDone), done
        got = landed(done.embeddings)
        assert done.rows == image.num_tokens and got.shape == (image.num_tokens, spec.embed_width)
        assert torch.equal(got, want)
    for item in items:
        assert item.pixels is not None
        ShmSegment.unlink(item.pixels.name)
    stats = sched.latest_stats(2)
    assert (stats.jobs, stats.images_encoded, stats.failed) == (2, 2, 0) and stats.vit_calls >= 1


def test_bad_pixels_fail_only_their_request(model_dir: Path, encoder: tuple[ServerConfig, Any]) -> None:
    config, sched = encoder
    processor = MMProcessor(model_dir)
    good, bad = (processor.process_image(noise_image(64, 64, seed=s)) for s in (5, 6))
    t, h, w = bad.grid
    items = [write_pixels(config.launch_id, good), write_pixels(config.launch_id, bad, (t, h * 2, w))]
    for item in items:  # one batch when the second is queued by the time the first is taken: either way the same
        sched.to_encoder.send(EncodeRequest(item.hash, [item]))
    answers = sched.answers(2)
    done, failed = answers[good.hash], answers[bad.hash]
    assert isinstance(done, EncodeDone) and done.rows == good.num_tokens
    landed(done.embeddings)
    assert isinstance(failed, EncodeFailed) and failed.status == 400 and "grid" in failed.error
    for item in items:
        assert item.pixels is not None
        ShmSegment.unlink(item.pixels.name)
    assert sched.latest_stats(2).failed == 1


def test_a_batch_is_answered_in_groups_of_a_quarter_call() -> None:
    """Groups keep order and stay under the patch cap, a request over it goes alone, and a key asked twice joins the
    group of its first asker (one encode)."""
    grid = (1, 16, 16)  # 256 patches

    def req(key: int, images: int = 1) -> EncodeRequest:
        return EncodeRequest(bytes([key]) * 16, [EncodeItem(bytes([key, i]) * 8, grid, 64, None) for i in range(images)])

    a, b, c, big, d = req(1), req(2), req(3), req(4, images=3), req(5)
    again = EncodeRequest(b.key, b.items, replica=1)
    groups = answer_groups([a, b, c, again, big, d], max_patches=512)
    assert groups == [[a, b, again], [c], [big], [d]]
    assert answer_groups([a, b, c], max_patches=10_000) == [[a, b, c]]
    assert answer_groups([], max_patches=512) == []


def test_queued_requests_land_one_group_at_a_time(demo_model_dir: Path, launch_id: str) -> None:
    """Three images a ViT call could take together, sent at once: each is encoded (a call of its own) and answered
    apart, so the first lands without waiting for the others; every entry still equals the tower's own."""
    processor = MMProcessor(demo_model_dir)
    images = [processor.process_image(noise_image(96, 64, seed=20 + i)) for i in range(3)]
    n = images[0].grid[0] * images[0].grid[1] * images[0].grid[2]
    assert all(im.grid == images[0].grid for im in images)
    engine = EngineConfig(model=str(demo_model_dir), spec=load_spec(demo_model_dir), vit_max_patches=3 * n)
    config = ServerConfig(engine, launch_id, "demo", encoder_workers=1, log_level="warning")
    items = [write_pixels(launch_id, im) for im in images]
    try:
        with running_encoder(config) as sched:
            for item in items:
                sched.to_encoder.send(EncodeRequest(item.hash, [item]))
            answers = sched.answers(3)
            stats = sched.latest_stats(3)
        for image, want in zip(images, reference(demo_model_dir, images), strict=True):
            done = answers[image.hash]
            assert isinstance(done, EncodeDone), done
            assert torch.equal(landed(done.embeddings), want)
        assert (stats.images_encoded, stats.vit_calls) == (3, 3)  # before: one call when the three were queued
    finally:
        for item in items:
            assert item.pixels is not None
            ShmSegment.unlink(item.pixels.name)
