"""A tokenizer's fresh images on its thread pool: the same request and bytes as one thread, and no
segment left behind when an image, the byte budget or /dev/shm fails midway."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import logging
import resource
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import torch

from ipc.control import RequestFailed
from ipc.prompts import TokenizedRequest
from ipc.requests import GenerateRequest
from ipc.shm import (
    ShmFullError,
    ShmSegment,
    list_segments,
    segment_name,
)
from server.config import ServerConfig
from tests.conftest import noise_image
from tests.workers.tokenizer.test_process import (
    MODEL,
    _handle,
    _inodes,
    chat_body,
    png,
    server_config,
    shm_path,
)
from workers.common.errors import BadRequest
from workers.engine.config import EngineConfig
from workers.engine.prompt.processor import MMProcessor, ProcessedImage
from workers.tokenizer.media.fetch import decode_image
from workers.tokenizer.media.image_segments import RequestImage
from workers.tokenizer.worker import TokenizerWorker

# ---- a request's fresh images on the worker's thread pool ------------------------------------------


def _pool_threads(index: int) -> int:
    """Live threads of tokenizer `index`'s image pool (named by ImagePrep)."""
    return sum(t.name.startswith(f"tok{index}-image") for t in threading.enumerate())


def _refusal(worker: TokenizerWorker, body: bytes) -> tuple[int, str | None, str | None]:
    result = worker.handle(GenerateRequest("refused", body, time.time()))
    assert isinstance(result, RequestFailed), result
    return result.status, result.code, result.param


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
            seen = _handle(worker, f"seed{threads}", chat_body([raws[2]]))
            req = _handle(worker, f"r{threads}", body)
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
        live = _handle(worker, "r0", chat_body([good[0]]))
        # Two bad images: the first in request order is the one reported, whichever fails first.
        truncated = good[3][: len(good[3]) // 2]
        body = chat_body([good[0], good[1], b"not an image", good[2], truncated])
        assert _refusal(worker, body) == (400, "invalid_image", "messages[0].content[3].image_url")
        body = chat_body([good[1], good[2], good[0], truncated])
        assert _refusal(worker, body) == (400, "invalid_image", "messages[0].content[4].image_url")
        def broken_third(images: list[bytes]) -> bytes:
            body = json.loads(chat_body(images))
            body["messages"][0]["content"][3]["image_url"]["url"] = "data:image/png;base64,***not-base64"
            return json.dumps(body).encode()

        # A data URL that is not base64 is refused before any image is decoded, a bad image before it included.
        assert _refusal(worker, broken_third([truncated, good[1], good[2]])) == (
            400, "invalid_base64", "messages[0].content[3].image_url"
        )
        assert list_segments(launch_id) == live.shm_names
        # The worker is fine afterwards: the good images alone go through, the live one linked.
        ok = _handle(worker, "r3", chat_body(good))
        assert len(ok.shm_names) == 4 and worker.images_reused == 1
        for name in live.shm_names + ok.shm_names:
            ShmSegment.unlink(name)
    finally:
        worker.close()


_T = TypeVar("_T")


def jpeg(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    noise_image(width, height, seed).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


class _Inline(Executor):
    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        future: Future[_T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:
            future.set_exception(exc)
        return future


def test_a_lone_fresh_image_is_processed_beside_the_prompt(demo_model_dir: Path, launch_id: str) -> None:
    """A request whose only fresh image is among resent ones (a chat's next round): that image is decoded on the
    first-image thread while the prompt is built, and the request is the one a single thread makes; a corrupt one
    (its header fine) is refused naming it, with nothing of the request left in shm. A PNG goes beside the prompt
    too (its orientation read from a one-pixel shell), an animated one stays on the calling thread (reading its
    orientation decodes it, so a second decode beside the prompt would cost more than it hides)."""
    worker = TokenizerWorker(server_config(demo_model_dir, launch_id), 0, logging.getLogger("test"))
    reference = TokenizerWorker(server_config(demo_model_dir, launch_id), 1, logging.getLogger("test"))
    threads: list[str] = []
    process = worker.prep._process

    def spy(image: RequestImage) -> ProcessedImage:
        threads.append(threading.current_thread().name)
        return process(image)

    worker.prep._process = spy  # type: ignore[method-assign]
    try:
        first, fresh = jpeg(64, 48, seed=70), jpeg(72, 40, seed=71)
        live = _handle(worker, "r0", chat_body([first]))
        assert threads == ["tok0-first_0"]
        got = _handle(worker, "r1", chat_body([first, fresh]))
        assert len(threads) == 2 and threads[1].startswith("tok0-first") and worker.images_reused == 1
        reference.prep.first.shutdown()
        reference.prep.first = _Inline()  # the reference processes every image on its calling thread
        want = reference.handle(GenerateRequest("r1", memoryview(chat_body([first, fresh])), time.time()))
        assert isinstance(want, tuple)
        assert got.input_ids == want[1].input_ids and [i.hash for i in got.items] == [i.hash for i in want[1].items]
        for a, b in zip(got.items, want[1].items, strict=True):
            assert a.pixels is not None and b.pixels is not None
            assert Path(shm_path(a.pixels.name)).read_bytes() == Path(shm_path(b.pixels.name)).read_bytes()
        truncated = jpeg(640, 480, seed=72)[:2000]
        body = chat_body([first, truncated])
        assert _refusal(worker, body) == (400, "invalid_image", "messages[0].content[2].image_url")
        as_png = _handle(worker, "r2", chat_body([first, png(72, 40, seed=73)]))
        assert threads[-1].startswith("tok0-first")
        buf = io.BytesIO()
        noise_image(40, 24, seed=74).save(buf, format="PNG", save_all=True, append_images=[noise_image(40, 24, seed=75)])
        animated = _handle(worker, "r3", chat_body([first, buf.getvalue()]))
        assert threads[-1] == threading.current_thread().name
        names = set(live.shm_names + got.shm_names + want[1].shm_names + as_png.shm_names + animated.shm_names)
        assert set(list_segments(launch_id)) == names
        for name in names:
            ShmSegment.unlink(name)
    finally:
        worker.close()
        reference.close()


def test_with_defer_the_first_fresh_image_decodes_before_the_others_are_read(
    demo_model_dir: Path, launch_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service's path (``defer``): a request's first fresh image goes to the first-image thread as soon as its own
    data URL is read and hashed, before the base64 of the others is undone, and the request is the one the path
    without ``defer`` makes. A bad data URL after it refuses the request naming it, with nothing left in shm; with a
    download to wait for, the bad data URL is refused at admission, before the download."""
    worker = TokenizerWorker(server_config(demo_model_dir, launch_id), 0, logging.getLogger("test"))
    reference = TokenizerWorker(server_config(demo_model_dir, launch_id), 1, logging.getLogger("test"))
    log: list[str] = []
    load = worker.fetcher.load_local
    monkeypatch.setattr(worker.fetcher, "load_local", lambda url, param=None: log.append(f"read {param}") or load(url, param))
    first = worker.prep.first

    class Recording(Executor):
        def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
            log.append(f"first {args[0].param}")
            return first.submit(fn, *args, **kwargs)

    worker.prep.first = Recording()
    param = "messages[0].content[{}].image_url".format
    images = [jpeg(64, 48, seed=80), jpeg(72, 40, seed=81), png(40, 56, seed=82)]
    try:
        body = chat_body(images)
        req = GenerateRequest("r1", memoryview(body), time.time())
        names: list[str] = []
        _, got, writes = worker._prepare(req, worker.admit(req), names, defer=True)
        assert log == [f"read {param(1)}", f"first {param(1)}", f"read {param(2)}", f"read {param(3)}"]
        for future in worker.prep.start_writes(writes):
            future.result()
        want = _handle(reference, "r1", body)
        assert got.input_ids == want.input_ids and len(got.items) == len(want.items) == 3
        for a, b in zip(got.items, want.items, strict=True):
            assert a.pixels is not None and b.pixels is not None
            assert Path(shm_path(a.pixels.name)).read_bytes() == Path(shm_path(b.pixels.name)).read_bytes()
        kept = set(list_segments(launch_id))

        good = base64.b64encode(b"not an image at all").decode()
        bad_body = chat_body([jpeg(80, 40, seed=83), b"not an image at all"]).replace(good.encode(), b"@@@@")
        bad = GenerateRequest("r2", memoryview(bad_body), time.time())
        with pytest.raises(BadRequest) as refused:
            worker._prepare(bad, worker.admit(bad), [], defer=True)
        assert refused.value.param == param(2)
        first.submit(int).result()  # the first image's thread is idle again: it wrote nothing
        assert set(list_segments(launch_id)) == kept

        remote = json.loads(bad_body)
        remote["messages"][0]["content"][1]["image_url"]["url"] = "http://127.0.0.1:9/page.png"
        with pytest.raises(BadRequest) as refused:
            worker.admit(GenerateRequest("r3", memoryview(json.dumps(remote).encode()), time.time()))
        assert refused.value.param == param(2)
    finally:
        worker.close()
        reference.close()
        for name in list_segments(launch_id):
            ShmSegment.unlink(name)


def test_budget_refusal_with_many_images_writes_nothing(demo_model_dir: Path, launch_id: str) -> None:
    config = dataclasses.replace(server_config(demo_model_dir, launch_id), tokenizer_threads=4)
    worker = TokenizerWorker(config, 0, logging.getLogger("test"))
    try:
        raws = [png(200, 150, seed=70 + k) for k in range(4)]
        one = _handle(worker, "r0", chat_body(raws[:1]))
        ShmSegment.unlink(one.shm_names[0])
        # Room left for about two of the four images: checked before any write, so none is written.
        worker.shm_bytes, worker.shm_budget = 8 * one.shm_bytes, 10 * one.shm_bytes + 1
        assert _refusal(worker, chat_body(raws))[:2] == (503, "shm_budget_exceeded")
        assert list_segments(launch_id) == []
        # A budget the four could never fit in: the client's problem, and again nothing written.
        worker.shm_bytes, worker.shm_budget = 0, 2 * one.shm_bytes + 1
        assert _refusal(worker, chat_body(raws))[:2] == (400, "images_too_large")
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
            refusal = _refusal(worker, body)
        assert refusal[:2] == (503, "shm_full")
        assert list_segments(launch_id) == []
        # Nothing stale is left behind either: with room again, the same request writes every image.
        again = _handle(worker, "r2", body)
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
        first = _handle(worker, "r1", chat_body([raw]))
        assert len(decoded) == 1 and first.shm_bytes > 0

        again = _handle(worker, "r2", chat_body([raw]))  # the same text: linked from its hash, no base64
        assert len(decoded) == 1 and again.shm_bytes == 0 and again.input_ids == first.input_ids
        assert _inodes(again) == _inodes(first)

        other_text = chat_body([raw]).replace(b"data:image/png;", b"data:image/x-png;")
        relabelled = _handle(worker, "r3", other_text)  # other text, same bytes: decoded once, then linked
        assert len(decoded) == 2 and relabelled.shm_bytes == 0 and _inodes(relabelled) == _inodes(first)

        pixels = Path(shm_path(first.shm_names[0])).read_bytes()
        for name in first.shm_names + again.shm_names + relabelled.shm_names:
            ShmSegment.unlink(name)
        # Its segments are gone: the URL is decoded after all, and the image processed and written again.
        fresh = _handle(worker, "r4", chat_body([raw]))
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
        ok = _handle(worker, "after", chat_body([png(64, 48, seed=3)]))
        assert len(ok.shm_names) == 1
        ShmSegment.unlink(ok.shm_names[0])
    finally:
        prep.shutdown()
        worker.close()
