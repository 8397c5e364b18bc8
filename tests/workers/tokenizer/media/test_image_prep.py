"""A tokenizer's fresh images on its thread pool: the same request and bytes as one thread, and no
segment left behind when an image, the byte budget or /dev/shm fails midway; resent data URLs not decoded again,
and the warm-up (a request's first fresh image beside its prompt: test_image_overlap.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import resource
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import torch

from ipc.prompts import TokenizedRequest
from ipc.shm import ShmFullError, ShmSegment, list_segments, segment_name
from server.config import ServerConfig
from tests.workers.tokenizer.harness import (
    MODEL,
    chat_body,
    handle,
    inodes,
    jpeg,
    png,
    refusal_of,
    server_config,
    shm_path,
)
from workers.engine.config import EngineConfig
from workers.engine.prompt.media_items import ProcessedImage
from workers.engine.prompt.processor import MMProcessor
from workers.tokenizer.media.fetch import decode_image
from workers.tokenizer.media.image_segments import RequestImage
from workers.tokenizer.worker import TokenizerWorker

# ---- a request's fresh images on the worker's thread pool ------------------------------------------


def _pool_threads(index: int) -> int:
    """Live threads of tokenizer `index`'s image pool (named by ImagePrep)."""
    return sum(t.name.startswith(f"tok{index}-image") for t in threading.enumerate())


def _snapshot(worker: TokenizerWorker, req: TokenizedRequest) -> tuple[bytes, list[bytes]]:
    """The request as the scheduler gets it, with the worker's random name part made neutral, and
    the bytes of every segment it names."""
    encoded = msgspec.json.encode(req).replace(worker.prep.nonce.encode(), b"NONCE-")
    return encoded, [Path(shm_path(name)).read_bytes() for name in req.shm_names]


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_pool_gives_the_same_request_and_bytes_as_one_thread(demo_model_dir: Path, launch_id: str, fmt: str) -> None:
    """JPEGs take the server's fast paths (simplejpeg, the resize in strips); their frames must be the bits of
    Pillow's decode and the processor's one-call resize, as PNGs' are."""
    engine = EngineConfig(model=str(demo_model_dir), max_model_len=4096, dtype="bfloat16")
    base = ServerConfig(engine=engine, launch_id=launch_id, served_model_name=MODEL, tokenizer_workers=1)
    sizes = [(64, 48), (300, 200), (56, 90), (448, 448), (120, 333), (200, 64)]
    encode = png if fmt == "png" else jpeg
    raws = [encode(w, h, seed=40 + k) for k, (w, h) in enumerate(sizes)]
    # Reused (linked from a live segment), fresh, and repeated within the request, all mixed.
    body = chat_body([raws[0], raws[1], raws[2], raws[0], raws[3], raws[4], raws[5]])
    log = logging.getLogger("test")
    snapshots = []
    for index, threads in enumerate((1, 4)):
        worker = TokenizerWorker(dataclasses.replace(base, tokenizer_threads=threads), index, log)
        try:
            seen = handle(worker, f"seed{threads}", chat_body([raws[2]]))
            req = handle(worker, f"r{threads}", body)
            assert req.rid == f"r{threads}"
            snapshots.append(_snapshot(worker, msgspec.structs.replace(req, rid="r")))
            # 5 fresh images: written concurrently by a pool of 4, inline (no pool thread) by a pool of 1.
            assert req.shm_bytes > 0 and len(req.shm_names) == 6 and worker.images_reused == 2
            assert _pool_threads(index) >= 2 if threads > 1 else _pool_threads(index) == 0
            for name in seen.shm_names + req.shm_names:
                ShmSegment.unlink(name)
        finally:
            worker.close()
        assert _pool_threads(index) == 0  # close() joins the pool
    assert snapshots[0] == snapshots[1]

    # And both are right: uint8 frames that a model worker makes into the bf16 of the float32 rows MMProcessor
    # makes in-process, in request order.
    mm = MMProcessor(demo_model_dir)
    assert mm.uint8_frames is not None
    layout = mm.uint8_frames[0]
    order = [raws[0], raws[1], raws[2], raws[0], raws[3], raws[4], raws[5]]
    expected = [mm.process_image(decode_image(raw, 10**6), image_hash=mm.media_hash(raw)) for raw in order]
    req = msgspec.json.decode(snapshots[1][0], type=TokenizedRequest)
    assert [(i.hash, i.grid) for i in req.items] == [(p.hash, p.grid) for p in expected]
    contents = dict(zip(req.shm_names, snapshots[1][1]))
    for item, processed in zip(req.items, expected):
        assert item.pixels is not None and item.pixels.dtype == "uint8"
        frame = torch.frombuffer(bytearray(contents[item.pixels.name]), dtype=torch.uint8).view(item.pixels.shape)
        assert torch.equal(layout.rows(frame, torch.bfloat16), processed.pixel_values.to(torch.bfloat16))


def test_bad_image_among_many_fails_the_request_and_leaves_no_segment(
    demo_model_dir: Path, launch_id: str
) -> None:
    config = dataclasses.replace(server_config(demo_model_dir, launch_id), tokenizer_threads=4)
    worker = TokenizerWorker(config, 0, logging.getLogger("test"))
    try:
        good = [png(64 + 8 * k, 48, seed=60 + k) for k in range(4)]
        # A live segment, which the requests below would link if they got that far.
        live = handle(worker, "r0", chat_body([good[0]]))
        # Two bad images: the first in request order is the one reported, whichever fails first.
        truncated = good[3][: len(good[3]) // 2]
        body = chat_body([good[0], good[1], b"not an image", good[2], truncated])
        assert refusal_of(worker, body) == (400, "invalid_image", "messages[0].content[3].image_url")
        body = chat_body([good[1], good[2], good[0], truncated])
        assert refusal_of(worker, body) == (400, "invalid_image", "messages[0].content[4].image_url")
        def broken_third(images: list[bytes]) -> bytes:
            body = json.loads(chat_body(images))
            body["messages"][0]["content"][3]["image_url"]["url"] = "data:image/png;base64,***not-base64"
            return json.dumps(body).encode()

        # A data URL that is not base64 is refused before any image is decoded, a bad image before it included.
        assert refusal_of(worker, broken_third([truncated, good[1], good[2]])) == (
            400, "invalid_base64", "messages[0].content[3].image_url"
        )
        assert list_segments(launch_id) == live.shm_names
        # The worker is fine afterwards: the good images alone go through, the live one linked.
        ok = handle(worker, "r3", chat_body(good))
        assert len(ok.shm_names) == 4 and worker.images_reused == 1
        for name in live.shm_names + ok.shm_names:
            ShmSegment.unlink(name)
    finally:
        worker.close()


def test_budget_refusal_with_many_images_writes_nothing(demo_model_dir: Path, launch_id: str) -> None:
    config = dataclasses.replace(server_config(demo_model_dir, launch_id), tokenizer_threads=4)
    worker = TokenizerWorker(config, 0, logging.getLogger("test"))
    try:
        raws = [png(200, 150, seed=70 + k) for k in range(4)]
        one = handle(worker, "r0", chat_body(raws[:1]))
        ShmSegment.unlink(one.shm_names[0])
        # Room left for about two of the four images: checked before any write, so none is written.
        worker.shm_bytes, worker.shm_budget = 8 * one.shm_bytes, 10 * one.shm_bytes + 1
        assert refusal_of(worker, chat_body(raws))[:2] == (503, "shm_budget_exceeded")
        assert list_segments(launch_id) == []
        # A budget the four could never fit in: the client's problem, and again nothing written.
        worker.shm_bytes, worker.shm_budget = 0, 2 * one.shm_bytes + 1
        assert refusal_of(worker, chat_body(raws))[:2] == (400, "images_too_large")
        assert list_segments(launch_id) == []
    finally:
        worker.close()


@contextlib.contextmanager
def _file_size_limit(launch_id: str, nbytes: int) -> Iterator[None]:
    """Files of this process may not grow past `nbytes`: tmpfs's fallocate then fails with EFBIG,
    which ShmSegment.create reports as ShmFullError, as for a full /dev/shm. SIGXFSZ is ignored
    meanwhile, or the kernel's signal would kill the process instead."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        with contextlib.suppress(ShmFullError):
            ShmSegment.create(probe := segment_name(launch_id, "probe"), 2 * nbytes).close()
            ShmSegment.unlink(probe)
            pytest.skip("this kernel's /dev/shm ignores RLIMIT_FSIZE")
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.mark.parametrize("threads", [1, 4])
def test_shm_full_midway_releases_the_images_already_written(
    demo_model_dir: Path, launch_id: str, threads: int
) -> None:
    config = dataclasses.replace(server_config(demo_model_dir, launch_id), tokenizer_threads=threads)
    worker = TokenizerWorker(config, 0, logging.getLogger("test"))
    try:
        small = [png(64, 64, seed=80 + k) for k in range(4)]  # ~10 KB uint8 frames each
        big = png(448, 448, seed=90)  # a ~600 KB frame
        # The big image is neither first nor last: small ones are written before and around it.
        body = chat_body([small[0], small[1], big, small[2], small[3]])
        with _file_size_limit(launch_id, 1 << 18):
            refusal = refusal_of(worker, body)
        assert refusal[:2] == (503, "shm_full")
        assert list_segments(launch_id) == []
        # Nothing stale is left behind either: with room again, the same request writes every image.
        again = handle(worker, "r2", body)
        assert len(again.shm_names) == 5 and worker.images_reused == 0
        for name in again.shm_names:
            ShmSegment.unlink(name)
    finally:
        worker.close()


# ---- resent data URLs ---------------------------------------------------------------------------------


def test_a_resent_data_url_is_not_decoded_while_its_image_is_live(
    demo_model_dir: Path, launch_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = TokenizerWorker(server_config(demo_model_dir, launch_id), 0, logging.getLogger("test"))
    decoded: list[str] = []
    load = worker.fetcher.load_local
    monkeypatch.setattr(worker.fetcher, "load_local", lambda url, param=None: decoded.append(url) or load(url, param))
    raw = png(80, 48, seed=31)
    try:
        first = handle(worker, "r1", chat_body([raw]))
        assert len(decoded) == 1 and first.shm_bytes > 0

        again = handle(worker, "r2", chat_body([raw]))  # the same text: linked from its hash, no base64
        assert len(decoded) == 1 and again.shm_bytes == 0 and again.input_ids == first.input_ids
        assert inodes(again) == inodes(first)

        other_text = chat_body([raw]).replace(b"data:image/png;", b"data:image/x-png;")
        relabelled = handle(worker, "r3", other_text)  # other text, same bytes: decoded once, then linked
        assert len(decoded) == 2 and relabelled.shm_bytes == 0 and inodes(relabelled) == inodes(first)

        pixels = Path(shm_path(first.shm_names[0])).read_bytes()
        for name in first.shm_names + again.shm_names + relabelled.shm_names:
            ShmSegment.unlink(name)
        # Its segments are gone: the URL is decoded after all, and the image processed and written again.
        fresh = handle(worker, "r4", chat_body([raw]))
        assert len(decoded) == 3 and fresh.shm_bytes == first.shm_bytes and fresh.input_ids == first.input_ids
        assert Path(shm_path(fresh.shm_names[0])).read_bytes() == pixels
        for name in fresh.shm_names:
            ShmSegment.unlink(name)
    finally:
        worker.close()


def test_warm_up_runs_the_image_path_on_every_image_thread_and_writes_nothing(
    demo_model_dir: Path, launch_id: str
) -> None:
    """serve_tokenizer warms the image path before the process reports ready: the processor's fast-path check has
    run, a 1080p probe went through decode, resize and the frame copy once on the prep thread, the first-image
    thread and each pool thread, and nothing of it is in shm or in the reuse hints."""
    config = dataclasses.replace(server_config(demo_model_dir, launch_id), tokenizer_threads=3)
    worker = TokenizerWorker(config, 0, logging.getLogger("test"))
    prep = ThreadPoolExecutor(1, thread_name_prefix="tok0-prep")
    seen: list[tuple[str, tuple[int, int, int]]] = []
    process = worker.prep._process

    def spy(image: RequestImage) -> ProcessedImage:
        out = process(image)
        seen.append((threading.current_thread().name, out.grid))
        return out

    try:
        assert "_frame_resizer" not in worker.processor.__dict__
        worker.prep._process = spy  # type: ignore[method-assign]
        assert (1920, 1080) not in worker.processor._grids
        worker.warm_up(prep)
        worker.prep._process = process  # type: ignore[method-assign]
        assert worker.processor.__dict__["_frame_resizer"] is not None
        assert (1920, 1080) in worker.processor._grids  # the prompt path ran too: a 1080p page's grid is known
        threads = sorted(name.rsplit("_", 1)[0] for name, _ in seen)
        assert threads == ["tok0-first"] + ["tok0-image"] * 3 + ["tok0-prep"], seen
        assert len({name for name, _ in seen}) == 5  # three distinct pool threads, the first-image and prep threads
        assert {grid for _, grid in seen} == {worker.processor.image_grid(1920, 1080)}
        assert _pool_threads(0) == 3 and list_segments(launch_id) == [] and not worker.prep.local
        ok = handle(worker, "after", chat_body([png(64, 48, seed=3)]))
        assert len(ok.shm_names) == 1
        ShmSegment.unlink(ok.shm_names[0])
    finally:
        prep.shutdown()
        worker.close()
