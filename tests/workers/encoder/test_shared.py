"""A shared encoder worker (``--shared-encoders``) as a real spawned process over real ZMQ and shm, the test playing
two replicas' schedulers: it announces itself to both, answers each request to the replica it names (the same image
asked by both is encoded once, from its recent entries the second time, and lands twice, once for each, so each
scheduler owns and unlinks its own), sends its counters to replica
0 alone (so the frontend's merge counts them once), and exits only after both schedulers' Shutdown. The config side:
how many encoders a launch starts, which ones a replica sends to, where they run and which GPUs read their pools."""

from __future__ import annotations

import multiprocessing
from dataclasses import replace
from pathlib import Path

from ipc.control import ProcessReady, Shutdown
from ipc.encode import EncodeDone, EncodeRequest
from ipc.landing import ShmLanding
from ipc.shm import ShmSegment
from server.config import ServerConfig
from tests.conftest import noise_image
from tests.workers.encoder.test_process import FakeScheduler, landed, write_pixels
from workers.encoder.process import run_encoder_worker
from workers.engine.config import EngineConfig
from workers.engine.models import load_spec
from workers.engine.prompt.processor import MMProcessor


def shared_config(model_dir: Path, launch_id: str, workers: int = 1, dp: int = 2) -> ServerConfig:
    engine = EngineConfig(model=str(model_dir), spec=load_spec(model_dir))
    return ServerConfig(engine, launch_id, "demo", encoder_workers=workers, shared_encoders=True, dp_size=dp,
                        log_level="warning")


def test_the_config_numbers_shared_encoders_for_the_launch(demo_model_dir: Path) -> None:
    own = replace(shared_config(demo_model_dir, "x", workers=2, dp=3), shared_encoders=False)
    assert (own.encoder_count, own.replica_encoders(1), own.encoder_replicas(3)) == (6, [2, 3], [1])
    shared = shared_config(demo_model_dir, "x", workers=3, dp=2)
    assert (shared.encoder_count, shared.replica_encoders(0), shared.replica_encoders(1)) == (3, [0, 1, 2], [0, 1, 2])
    assert shared.encoder_replicas(2) == [0, 1]
    # CUDA without --encoder-devices: encoder j on replica j % dp's LM GPUs, spread over its TP ranks; its pool read by
    # every replica's GPUs, since any replica may import from it.
    cuda = replace(shared, engine=replace(shared.engine, device="cuda", tp_size=2))
    assert [cuda.encoder_device(j) for j in range(3)] == ["cuda:0", "cuda:2", "cuda:1"]
    assert cuda.encoder_readers(1) == [0, 1, 2, 3]
    assert replace(cuda, shared_encoders=False, encoder_workers=1).encoder_readers(1) == [2, 3]
    assert replace(cuda, encoder_devices=(6, 7)).encoder_device(2) == "cuda:6"


def test_a_shared_encoder_answers_the_replica_that_asked(demo_model_dir: Path, launch_id: str) -> None:
    config = shared_config(demo_model_dir, launch_id)
    scheds = [FakeScheduler(config, 0), FakeScheduler(config, 1)]
    proc = multiprocessing.get_context("spawn").Process(target=run_encoder_worker, args=(config, 0), daemon=True)
    proc.start()
    try:
        for sched in scheds:
            ready = sched.recv()
            assert isinstance(ready, ProcessReady) and ready.role == "encoder" and ready.pid == proc.pid
        image = MMProcessor(demo_model_dir).process_image(noise_image(96, 64, seed=3))
        item = write_pixels(launch_id, image)
        names = []
        for replica in (1, 0):  # the same image from both replicas: each gets a landing of its own
            scheds[replica].to_encoder.send(EncodeRequest(item.hash, [item], replica))
            done = scheds[replica].recv()
            assert isinstance(done, EncodeDone) and done.rows == image.num_tokens, done
            assert isinstance(done.embeddings, ShmLanding)
            names.append(done.embeddings.name)
            landed(done.embeddings)
        assert names[0] != names[1]
        stats = scheds[0].latest_stats(2)  # both replicas' jobs, reported to replica 0
        # Encoded once: replica 0 was answered from the encoder's recent entries (--encoder-cache-mb).
        assert (stats.jobs, stats.images_encoded, stats.reused) == (2, 1, 1) and stats.recent_bytes > 0
        assert scheds[1].stats == [] and scheds[1].inbound.recv(300) is None  # and to nobody else
        assert item.pixels is not None
        ShmSegment.unlink(item.pixels.name)
        scheds[0].to_encoder.send(Shutdown("replica 0 stopping"))
        proc.join(1.0)
        assert proc.is_alive(), "a shared encoder must outlive one replica's Shutdown"
        scheds[1].to_encoder.send(Shutdown("replica 1 stopping"))
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        for sched in scheds:
            sched.close()
