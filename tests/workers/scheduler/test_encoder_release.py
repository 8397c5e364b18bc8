"""The scheduler's side of CUDA landings (ipc/landing.py), in process with fake sockets for the model ranks and two
encoder workers: an entry landed in an encoder's pool is released to that encoder (``EncodeRelease``, exactly once)
when the step that imported it is back, or when the request waiting on it is aborted before any plan imports it;
no shared-memory unlink is ever attempted for it and it never counts in the shm budget. A segment landing in the
same scheduler is still unlinked and counted, as before."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipc.encode import EncodeDone, EncodeRelease, EncodeRequest
from ipc.landing import CudaLanding, CudaPoolHandle, ShmLanding, cuda_landing_name
from ipc.prompts import MMItem
from ipc.shm import segment_name
from ipc.steps import StepPlan, StepResult
from server.config import ServerConfig
from tests.conftest import noise_image
from tests.workers.scheduler.process_stack import GREEDY, chat, shm_ref
from workers.engine.config import EngineConfig
from workers.engine.prompt.processor import MMProcessor
from workers.scheduler import base
from workers.scheduler.process import Scheduler, build_core

POOL = CudaPoolHandle(0, b"\x01" * 64, 1 << 30, 0, b"/torch_1_2", 0, b"\x00" * 64, False)


class FakeSock:
    """A PUSH socket that keeps what is sent (plans as bytes, messages as objects)."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)

    def close(self, linger_ms: int = 0) -> None:
        pass

    def releases(self) -> list[str]:
        return [name for m in self.sent if isinstance(m, EncodeRelease) for name in m.names]

    def requests(self) -> list[EncodeRequest]:
        return [m for m in self.sent if isinstance(m, EncodeRequest)]


@pytest.fixture
def sched(demo_model_dir: Path, launch_id: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Scheduler]:
    engine = EngineConfig(str(demo_model_dir), max_model_len=4096, chunk_size=64)
    config = ServerConfig(engine, launch_id, "demo", encoder_workers=2, log_level="warning")
    s = Scheduler(config, logging.getLogger("test.scheduler"))
    for sock in [*s.models, *s.encoders]:
        sock.close()
    s.models = [FakeSock()]  # type: ignore[list-item]
    s.encoders = [FakeSock(), FakeSock()]  # type: ignore[list-item]
    s.encoding.socks = s.encoders
    s.core = build_core(config, 256)
    s.core.on_finished = s._release
    assert s.core.remote is not None
    s.core.remote.on_unlink = s.unlink
    unlinked: list[str] = []
    monkeypatch.setattr(base.ShmSegment, "unlink", staticmethod(unlinked.append))
    s.unlinked = unlinked  # type: ignore[attr-defined]
    yield s
    s.close()


def add_request(s: Scheduler, processor: MMProcessor, rid: str, seed: int) -> MMItem:
    image = noise_image(64, 48, seed=seed)
    processed = processor.process_image(image)
    prompt = processor.build(processor.render(chat("What is this?", [image])), [processed])
    [span] = prompt.spans
    ref = shm_ref(segment_name(s.config.launch_id, f"{processed.hash.hex()}-px"), processed.pixel_values)
    item = MMItem(span.hash, span.offset, span.length, span.grid, ref)
    s.core.add(rid, prompt.input_ids, prompt.mrope_delta, [item], GREEDY)
    return item


def requested(s: Scheduler) -> dict[bytes, int]:
    """Key -> the encoder (socks' index) each encode request went to."""
    s._dispatch_encodes()
    return {r.key: j for j, sock in enumerate(s.encoders) for r in sock.requests()}  # type: ignore[attr-defined]


def cuda_done(s: Scheduler, key: bytes, encoder: int, rows: int, serial: int) -> CudaLanding:
    ref = CudaLanding(cuda_landing_name(encoder, serial), encoder, POOL, serial * 4096, rows * 64, "bfloat16",
                      (rows, 32))
    s._on_encode_done(EncodeDone(encoder, key, rows, ref))
    return ref


def finish_oldest(s: Scheduler) -> None:
    plan = s.in_flight[0]
    s._on_result(StepResult(plan.step_id, [(c.rid, 7) for c in plan.chunks if c.sample]))


def run_until_imported(s: Scheduler, key: bytes) -> StepPlan:
    """Plan steps (as the loop does, one ahead) and finish them oldest first until one imports ``key``; that plan,
    still in flight."""
    for _ in range(50):
        s._plan_steps()
        for plan in s.in_flight:
            if any(imp.key == key for imp in plan.mm_import):
                return plan
        finish_oldest(s)
    raise AssertionError("no plan imported the landed entry")


@pytest.fixture(scope="module")
def processor(demo_model_dir: Path) -> MMProcessor:
    return MMProcessor(demo_model_dir)


def test_a_cuda_landing_is_released_to_its_encoder_once_its_import_step_is_back(
    sched: Scheduler, processor: MMProcessor
) -> None:
    item = add_request(sched, processor, "r1", seed=1)
    sched._plan_steps()  # admits the request: its image goes to an encoder
    [(key, j)] = requested(sched).items()
    assert key == item.hash
    ref = cuda_done(sched, key, j, item.length, serial=0)
    assert sched.ledger.landing_bytes == 0 and sched.ledger.used_bytes == 0  # GPU memory: not in the shm budget
    plan = run_until_imported(sched, key)
    [imp] = plan.mm_import
    assert imp.embeddings == ref and not imp.transient
    # The step that copies it is still running: nothing released yet.
    sched.unlink([ref.name])  # (an abort at this moment asks too: deferred, not sent twice)
    assert all(sock.releases() == [] for sock in sched.encoders)  # type: ignore[attr-defined]
    while plan in sched.in_flight:
        finish_oldest(sched)
    sched._flush_unlinks()
    releases = [sock.releases() for sock in sched.encoders]  # type: ignore[attr-defined]
    assert releases[j] == [ref.name] and releases[1 - j] == []
    assert ref.name not in sched.unlinked  # type: ignore[attr-defined]
    sched.unlink([ref.name])  # a late second ask is dropped: released exactly once
    assert [sock.releases() for sock in sched.encoders] == releases  # type: ignore[attr-defined]
    assert ref.name not in sched.unlinked and sched.encoding.pool_landings == {}  # type: ignore[attr-defined]


def test_an_aborted_request_releases_its_landed_entry(sched: Scheduler, processor: MMProcessor) -> None:
    items = [add_request(sched, processor, rid, seed=10 + i) for i, rid in enumerate(("a", "b"))]
    sched._plan_steps()
    sent = requested(sched)
    assert set(sent) == {it.hash for it in items} and set(sent.values()) == {0, 1}  # one per encoder
    a, b = items
    ref_a = cuda_done(sched, a.hash, sent[a.hash], a.length, serial=0)
    # The other entry lands in shared memory (its encoder's pool was full): counted in the budget, unlinked.
    shm = ShmLanding(segment_name(sched.config.launch_id, "emb-b"), b.length * 64, "bfloat16", (b.length, 32))
    sched._on_encode_done(EncodeDone(sent[b.hash], b.hash, b.length, shm))
    assert sched.ledger.landing_bytes == shm.nbytes
    landed = sched.core.remote.landed if sched.core.remote is not None else {}
    assert a.hash in landed  # not imported yet: no plan ran a chunk that reads it since
    sched._on_abort("a")
    sched._on_abort("b")
    sched._flush_unlinks()
    releases = [sock.releases() for sock in sched.encoders]  # type: ignore[attr-defined]
    assert releases[sent[a.hash]] == [ref_a.name] and releases[sent[b.hash]] == []
    assert sched.unlinked == [shm.name]  # type: ignore[attr-defined]
    assert sched.ledger.landing_bytes == 0


