"""CUDA landing through IPC (workers/encoder/cuda_landing.py, runner/landing.py), on a GPU: the real encoder tower
lands an entry in its pool, and a consumer in another process (spawned, as a model worker is) opens the pool from
the ``CudaLanding`` alone and reads bit-identical rows, on the pool's GPU and, with two GPUs, peer to peer. A pool
too small for an entry lands it in shared memory instead; a released range is handed out again."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import msgspec
import pytest
import torch

from ipc.encode import EncodeDone, EncodeRequest
from ipc.landing import CudaLanding, ShmLanding
from ipc.shm import ShmSegment, segment_name
from ipc.steps import EncodeItem
from tests.conftest import noise_image
from workers.encoder.cuda_landing import open_pool
from workers.encoder.tower import EncoderTower
from workers.engine.config import EngineConfig
from workers.engine.models import load_spec
from workers.engine.prompt.processor import MMProcessor
from workers.engine.runner.landing import LandingReader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def read_in_another_process(ref_bytes: bytes, device: int, out: multiprocessing.Queue[bytes | str]) -> None:
    """The consumer: decode the ref, open the pool (CUDA IPC), copy the rows to ``device``, send them back."""
    try:
        ref = msgspec.msgpack.decode(ref_bytes, type=CudaLanding)
        torch.cuda.set_device(device)
        reader = LandingReader(torch.device("cuda", device))
        rows = reader.rows(ref).to(torch.device("cuda", device), copy=True)
        again = reader.rows(ref)  # cached: no second cudaIpcOpenMemHandle
        assert reader.pools == 1 and again.data_ptr() == reader.rows(ref).data_ptr()
        out.put(rows.cpu().view(torch.uint8).numpy().tobytes())
        reader.close()
    except Exception as exc:  # the parent asserts on it
        out.put(f"{type(exc).__name__}: {exc}")


def encode_one(tower: EncoderTower, launch_id: str, processor: MMProcessor, seed: int) -> EncodeDone:
    image = processor.process_image(noise_image(120, 90, seed=seed))
    name = segment_name(launch_id, f"{image.hash.hex()}-{time.monotonic_ns():x}")
    seg, ref = ShmSegment.create_from_tensor(name, image.pixel_values)
    seg.close()
    try:
        [done] = tower.run([EncodeRequest(image.hash, [EncodeItem(image.hash, image.grid, image.num_tokens, ref)])])
    finally:
        ShmSegment.unlink(name)
    assert isinstance(done, EncodeDone), done
    return done


def test_another_process_reads_the_landed_rows_bit_for_bit(demo_model_dir: Path, launch_id: str) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    engine = EngineConfig(model=str(demo_model_dir), spec=load_spec(demo_model_dir), device="cuda")
    tower = EncoderTower(engine, launch_id, 0, device)
    readers = list(range(min(2, torch.cuda.device_count())))
    tower.pool = open_pool(0, device, 16 << 20, readers)
    assert tower.pool is not None
    processor = MMProcessor(demo_model_dir)
    done = encode_one(tower, launch_id, processor, seed=3)
    ref = done.embeddings
    assert isinstance(ref, CudaLanding) and ref.offset % 256 == 0 and ref.shape[0] == done.rows
    want = tower.pool.buffer[ref.offset:ref.offset + ref.nbytes].cpu().numpy().tobytes()
    ctx = multiprocessing.get_context("spawn")
    for reader_device in readers:  # the pool's own GPU, then (two GPUs) a peer
        out: multiprocessing.Queue[bytes | str] = ctx.Queue()
        proc = ctx.Process(target=read_in_another_process, args=(msgspec.msgpack.encode(ref), reader_device, out))
        proc.start()
        got = out.get(timeout=120)
        proc.join(60)
        assert got == want, got if isinstance(got, str) else "rows differ"
        assert proc.exitcode == 0
    # Released, its range is the next entry's; a pool with no room sends the entry through shared memory.
    assert tower.pool.release([ref.name]) == 1 and tower.pool.used_bytes == 0
    second = encode_one(tower, launch_id, processor, seed=4).embeddings
    assert isinstance(second, CudaLanding) and second.offset == ref.offset
    tower.pool = open_pool(0, device, 256, readers)
    assert tower.pool is not None
    third = encode_one(tower, launch_id, processor, seed=5).embeddings
    assert isinstance(third, ShmLanding)
    ShmSegment.unlink(third.name)
    assert (tower.cuda_landings, tower.shm_landings) == (2, 1)
