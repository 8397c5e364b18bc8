"""A shared encoder's recent entries (workers/encoder/recent.py) and what the tower does with them: a key it holds
is answered without a ViT run, two requests for one key in one batch share one encode, and every asker still gets a
landing of its own with the same rows (each replica's scheduler owns and unlinks its own)."""

from __future__ import annotations

from pathlib import Path

import torch

from ipc.encode import EncodeDone, EncodeRequest
from ipc.landing import ShmLanding
from ipc.shm import ShmSegment
from tests.conftest import noise_image
from tests.workers.encoder.test_process import landed, reference, write_pixels
from workers.encoder.recent import RecentEntries
from workers.encoder.tower import EncoderTower
from workers.engine.config import EngineConfig
from workers.engine.models import load_spec
from workers.engine.prompt.processor import MMProcessor


def test_least_recently_used_entries_go_first_within_the_byte_budget() -> None:
    recent = RecentEntries(3 * 400)  # three 100 x float32 entries
    entries = {bytes([i]): torch.full((100,), float(i)) for i in range(4)}
    for key in list(entries)[:3]:
        recent.put(key, entries[key])
    assert recent.get(b"\x00") is not None  # now the most recent: b"\x01" is the oldest
    recent.put(b"\x03", entries[b"\x03"])
    assert recent.get(b"\x01") is None and len(recent) == 3 and recent.bytes == 1200
    entries[b"\x03"].zero_()  # the encoder's buffer reused: the kept copy is its own
    held = recent.get(b"\x03")
    assert held is not None and bool((held == 3).all())
    recent.put(b"big", torch.zeros(301, dtype=torch.float32))  # larger than the whole budget: not kept
    assert recent.get(b"big") is None and len(recent) == 3


def test_the_tower_answers_each_asker_from_one_encode(demo_model_dir: Path, launch_id: str) -> None:
    engine = EngineConfig(model=str(demo_model_dir), spec=load_spec(demo_model_dir))
    tower = EncoderTower(engine, launch_id, 0, torch.device("cpu"))
    tower.recent = RecentEntries(64 << 20)
    processor = MMProcessor(demo_model_dir)
    images = [processor.process_image(noise_image(w, h, seed=20 + i)) for i, (w, h) in enumerate([(96, 64), (57, 83)])]
    items = [write_pixels(launch_id, im) for im in images]
    want = reference(demo_model_dir, images)
    try:
        # One batch: replicas 1 and 0 ask for the first image, replica 0 for the second too.
        batch = [EncodeRequest(items[0].hash, [items[0]], 1), EncodeRequest(items[0].hash, [items[0]], 0),
                 EncodeRequest(items[1].hash, [items[1]], 0)]
        answers = tower.run(batch)
        assert tower.counters.images_encoded == 2 and tower.reused == 1
        assert all(isinstance(a, EncodeDone) and isinstance(a.embeddings, ShmLanding) for a in answers)
        names = {a.embeddings.name for a in answers if isinstance(a, EncodeDone)}
        assert len(names) == 3  # a landing per asker
        rows = [landed(a.embeddings) for a in answers if isinstance(a, EncodeDone) and isinstance(a.embeddings, ShmLanding)]
        for got, i in zip(rows, (0, 0, 1), strict=True):
            torch.testing.assert_close(got, want[i], rtol=1e-5, atol=1e-5)
        # Later, another replica asks for the first image again: the encoder holds it, no ViT run.
        [again] = tower.run([EncodeRequest(items[0].hash, [items[0]], 1)])
        assert isinstance(again, EncodeDone) and isinstance(again.embeddings, ShmLanding)
        assert torch.equal(landed(again.embeddings), rows[0])
        assert tower.counters.images_encoded == 2 and tower.reused == 2 and tower.jobs == 4
        # Without recent entries (an encoder of one replica) the same request runs the ViT again.
        tower.recent = None
        [fresh] = tower.run([EncodeRequest(items[0].hash, [items[0]], 0)])
        assert isinstance(fresh, EncodeDone) and isinstance(fresh.embeddings, ShmLanding)
        landed(fresh.embeddings)
        assert tower.counters.images_encoded == 3 and tower.reused == 2
    finally:
        for item in items:
            assert item.pixels is not None
            ShmSegment.unlink(item.pixels.name)
