"""``mm_processor_kwargs`` through the tokenizer against transformers' own processor with the same arguments: the
prompt tokens (image and video pads as the processor writes them) and grids of images under ``min_pixels`` /
``max_pixels`` and of videos under ``fps``, ``num_frames`` and ``do_sample_frames`` (false: every frame, as a
Qwen2.5-VL checkpoint's shipped processor takes them). Settings are part of the media's identity; the uuid registry's
records are swept with the launch's segments."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoProcessor
from transformers.video_utils import read_video_pyav

from ipc import shm
from ipc.control import RequestFailed
from ipc.requests import GenerateRequest
from tests.conftest import noise_image
from tests.videos import make_video
from tests.workers.tokenizer.harness import MODEL, handle, inodes, png, refusal_of, server_config
from workers.engine.prompt.media_items import PAD_BASE
from workers.tokenizer.media.uuids import MediaRecord, UuidRegistry
from workers.tokenizer.worker import TokenizerWorker

VIDEO = make_video(frames=23, width=98, height=62, fps=10, seed=4)  # 2.3 s


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def family_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue("demo_model_dir" if request.param == "qwen2_5_vl" else "qwen3_model_dir"))


@pytest.fixture(scope="module")
def hf(family_dir: Path) -> Any:
    return AutoProcessor.from_pretrained(str(family_dir))


@pytest.fixture
def worker(family_dir: Path, launch_id: str) -> Iterator[TokenizerWorker]:
    w = TokenizerWorker(server_config(family_dir, launch_id), 0, logging.getLogger("test"))
    yield w
    w.close()


def body(part: dict[str, Any], kwargs: dict[str, Any]) -> bytes:
    content = [part, {"type": "text", "text": "What is it?"}]
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                       "mm_processor_kwargs": kwargs}).encode()


def ours(worker: TokenizerWorker, part: dict[str, Any], kwargs: dict[str, Any], pad: int) -> tuple[list[int], Any]:
    """The tokenizer's prompt (pads written as ``pad``, as the processor writes them) and its media items."""
    tok = handle(worker, f"r{time.monotonic_ns()}", body(part, kwargs))
    worker.prep.release(tok.shm_names)  # the scheduler's job when serving
    return [pad if t >= PAD_BASE else t for t in tok.input_ids], tok.items


def template(hf: Any, kind: str) -> str:
    messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "What is it?"}]}]
    return str(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


@pytest.mark.filterwarnings("ignore:Passing `min_pixels`:FutureWarning")  # the arguments vLLM users send
@pytest.mark.parametrize("kwargs", [{"max_pixels": 96 * 96}, {"min_pixels": 400 * 300}, {"min_pixels": 64 * 64, "max_pixels": 200 * 150}])
def test_image_pixel_range_matches_transformers(worker: TokenizerWorker, hf: Any, kwargs: dict[str, Any]) -> None:
    raw = png(230, 170, seed=5)
    url = f"data:image/png;base64,{base64.b64encode(raw).decode()}"
    ids, items = ours(worker, {"type": "image_url", "image_url": {"url": url}}, kwargs, worker.processor.info.image_token_id)
    want = hf(text=[template(hf, "image")], images=[noise_image(230, 170, seed=5)], return_tensors="pt", **kwargs)
    assert ids == want["input_ids"][0].tolist()
    assert [i.grid for i in items] == [tuple(want["image_grid_thw"][0].tolist())]
    default, _ = ours(worker, {"type": "image_url", "image_url": {"url": url}}, {}, 0)
    plain = ours(worker, {"type": "image_url", "image_url": {"url": url}}, {}, 0)[1]
    assert items[0].hash != plain[0].hash and len(default) != len(ids)  # another image to every cache


@pytest.mark.filterwarnings("ignore:Passing `min_pixels`:FutureWarning")
@pytest.mark.parametrize("kwargs", [{}, {"fps": 4}, {"fps": 1.5}, {"num_frames": 6}, {"do_sample_frames": False},
                                    {"fps": 3, "max_pixels": 64 * 64}])
def test_video_sampling_matches_transformers(worker: TokenizerWorker, hf: Any, kwargs: dict[str, Any]) -> None:
    url = f"data:video/mp4;base64,{base64.b64encode(VIDEO).decode()}"
    if "max_pixels" in kwargs and worker.processor.info.family != "qwen2_5_vl":
        # Qwen3-VL's video processor takes no per-frame range (transformers' ignores it): refused, not ignored.
        failed = worker.handle(GenerateRequest("r", body({"type": "video_url", "video_url": {"url": url}}, kwargs), 0.0))
        assert isinstance(failed, RequestFailed) and failed.param == "mm_processor_kwargs.max_pixels"
        return
    ids, items = ours(worker, {"type": "video_url", "video_url": {"url": url}}, kwargs, worker.processor.info.video_token_id)
    frames, meta = read_video_pyav(io.BytesIO(VIDEO), lambda metadata, **_: np.arange(metadata.total_num_frames))
    vp = hf.video_processor
    sampling: dict[str, Any] = dict(kwargs)
    if kwargs.get("do_sample_frames") is not False:
        sampling["do_sample_frames"] = True
        if "fps" not in kwargs and "num_frames" not in kwargs:  # the rate glimpse samples at by default
            sampling["fps"] = float(vp.fps) if getattr(vp, "fps", None) else 2.0
        elif "num_frames" in kwargs:
            sampling["fps"] = None  # else Qwen3-VL's call adds its own fps, which num_frames excludes
    want = hf(text=[template(hf, "video")], videos=[frames], video_metadata=[meta], cap_pixels_per_frame=False,
              return_tensors="pt", **sampling)
    assert ids == want["input_ids"][0].tolist()
    t, h, w = want["video_grid_thw"][0].tolist()
    assert [i.grid for i in items] == [(1, h, w)] * t


def test_naming_the_default_keeps_the_identity(worker: TokenizerWorker) -> None:
    video = {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{base64.b64encode(VIDEO).decode()}"}}
    assert worker.videos.video is not None
    plain = [i.hash for i in ours(worker, video, {}, 0)[1]]
    assert [i.hash for i in ours(worker, video, {"fps": worker.videos.video.fps, "do_sample_frames": True}, 0)[1]] == plain
    size = worker.processor.image_processor.size
    pixels = {"min_pixels": int(size.shortest_edge), "max_pixels": int(size.longest_edge)}
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(png(60, 40, 7)).decode()}"}}
    assert [i.hash for i in ours(worker, image, pixels, 0)[1]] == [i.hash for i in ours(worker, image, {}, 0)[1]]
    assert ours(worker, video, {"fps": 1}, 0)[1][0].hash != plain[0]


@pytest.mark.parametrize("family_dir", ["qwen2_5_vl"], indirect=True)  # Qwen3-VL's processor samples frames itself
def test_do_sample_frames_false_is_the_qwen2_5_checkpoints_own(worker: TokenizerWorker, hf: Any) -> None:
    assert not hf.video_processor.do_sample_frames
    url = f"data:video/mp4;base64,{base64.b64encode(VIDEO).decode()}"
    ids, _ = ours(worker, {"type": "video_url", "video_url": {"url": url}}, {"do_sample_frames": False},
                  worker.processor.info.video_token_id)
    frames, meta = read_video_pyav(io.BytesIO(VIDEO), lambda metadata, **_: np.arange(metadata.total_num_frames))
    want = hf(text=[template(hf, "video")], videos=[frames], video_metadata=[meta], return_tensors="pt")
    assert ids == want["input_ids"][0].tolist()


def test_a_uuid_names_the_image_while_its_segment_lives(worker: TokenizerWorker, launch_id: str) -> None:
    url = f"data:image/png;base64,{base64.b64encode(png(90, 70, seed=6)).decode()}"
    sent = handle(worker, "a", body({"type": "image_url", "image_url": {"url": url}, "uuid": "u1"}, {}))
    assert [i.uuid for i in sent.items] == ["u1"] and sent.items[0].external_id == "u1"  # what KV events name it by
    other = TokenizerWorker(worker.config, 1, logging.getLogger("test"))  # another tokenizer process of the launch
    try:
        named = handle(other, "b", body({"type": "image_url", "image_url": None, "uuid": "u1"}, {}))
    finally:
        other.close()
    assert named.input_ids == sent.input_ids and [i.uuid for i in named.items] == ["u1"]
    assert inodes(named) == inodes(sent)  # the same pixels, linked: nothing decoded or written
    worker.prep.release(sent.shm_names + named.shm_names)  # the segment is gone (the scheduler's unlink)
    gone = refusal_of(worker, body({"type": "image_url", "uuid": "u1"}, {}))
    assert gone == (400, "media_not_cached", "messages[0].content[0].uuid")
    assert shm.sweep(launch_id) == 1  # the record, nothing else left


def test_uuid_records_live_under_the_launch_prefix_and_are_swept(launch_id: str) -> None:
    registry = UuidRegistry(launch_id, idle_s=60.0, nonce="t-")
    registry.put("a", MediaRecord("image", bytes(16)))
    registry.put("b", MediaRecord("image", bytes(range(16))))
    registry.put("a", MediaRecord("image", b"\x01" * 16))  # last writer wins
    assert registry.get("a") == MediaRecord("image", b"\x01" * 16) and registry.get("zz") is None
    assert len(shm.list_segments(launch_id)) == 2  # no temporary file left behind
    old = time.time() - 120
    os.utime(os.path.join(shm.SHM_DIR, registry.name("b")), (old, old))
    assert registry.prune() == 1 and registry.get("b") is None and registry.get("a") is not None
    assert shm.sweep(launch_id) == 1 and shm.list_segments(launch_id) == []
