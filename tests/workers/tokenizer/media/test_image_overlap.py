"""A request's first fresh image processed beside its prompt: decoded on the first-image thread while the prompt is
built (a chat's next round, one fresh image among resent ones), and with ``defer`` (the service's overlap of
preprocessing and prefill) from the moment its own data URL is read, before the others are; either way the
request is the one a single thread makes, and a bad image refuses it with nothing left in shm."""

from __future__ import annotations

import base64
import io
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, TypeVar

import pytest

from ipc.requests import GenerateRequest
from ipc.shm import ShmSegment, list_segments
from tests.conftest import noise_image
from tests.workers.tokenizer.harness import chat_body, handle, jpeg, png, refusal_of, server_config, shm_path
from workers.common.errors import BadRequest
from workers.engine.prompt.media_items import ProcessedImage
from workers.tokenizer.media.image_segments import RequestImage
from workers.tokenizer.worker import TokenizerWorker

_T = TypeVar("_T")


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
        live = handle(worker, "r0", chat_body([first]))
        assert threads == ["tok0-first_0"]
        got = handle(worker, "r1", chat_body([first, fresh]))
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
        assert refusal_of(worker, body) == (400, "invalid_image", "messages[0].content[2].image_url")
        as_png = handle(worker, "r2", chat_body([first, png(72, 40, seed=73)]))
        assert threads[-1].startswith("tok0-first")
        buf = io.BytesIO()
        noise_image(40, 24, seed=74).save(buf, format="PNG", save_all=True, append_images=[noise_image(40, 24, seed=75)])
        animated = handle(worker, "r3", chat_body([first, buf.getvalue()]))
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
        want = handle(reference, "r1", body)
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
