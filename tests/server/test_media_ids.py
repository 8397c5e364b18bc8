"""Per-request media settings and client media ids through the real server, as a user sends them with the official
client: ``extra_body={"mm_processor_kwargs": ...}`` and content parts with a ``uuid`` (plain dicts).

A part sent with data and a uuid can be named on a later turn by the uuid alone (``image_url``/``video_url`` null or
left out): the same prompt, the same greedy answer, its tokens from the prefix cache. Once the server no longer holds
the media's pixels (here: retained segments expire after ``--shm-retain-idle-s``), naming it is a 400 naming the
uuid, as is a uuid never sent; bad settings are 400s naming ``mm_processor_kwargs.<key>``."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.live import LiveServer, data_url, png_bytes, serving
from tests.videos import make_video

IDLE_S = 2.0  # retained segments (and so named media) expire after this long unused
IMAGE = png_bytes(320, 240, seed=31)
VIDEO = make_video(frames=21, width=98, height=62, fps=10, seed=3)


@pytest.fixture(scope="module")
def server(demo_model_dir: Path) -> Iterator[LiveServer]:
    yield from serving(demo_model_dir, "--shm-retain-idle-s", str(IDLE_S))


def image_part(raw: bytes | None, uuid: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": data_url(raw)} if raw is not None else None}
    return part if uuid is None else {**part, "uuid": uuid}


def video_part(raw: bytes | None, uuid: str) -> dict[str, Any]:
    url = f"data:video/mp4;base64,{base64.b64encode(raw).decode()}" if raw is not None else None
    return {"type": "video_url", "video_url": {"url": url} if url else None, "uuid": uuid}


def ask(server: LiveServer, part: dict[str, Any], **extra: Any) -> tuple[str, int, int]:
    out = server.client().chat.completions.create(
        model="demo", max_tokens=6, temperature=0.0,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}],  # type: ignore[misc,list-item]
        extra_body=extra or None,
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    cached = out.usage.prompt_tokens_details.cached_tokens or 0
    return out.choices[0].message.content or "", out.usage.prompt_tokens, cached


def refused(server: LiveServer, part: dict[str, Any], **extra: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        ask(server, part, **extra)
    return err.value


def param(err: openai.BadRequestError) -> str:
    body = err.body if isinstance(err.body, dict) else {}
    return str(body.get("param"))


def test_a_uuid_names_media_sent_before_until_the_server_lets_it_go(server: LiveServer) -> None:
    text, prompt, _ = ask(server, image_part(IMAGE, "photo-1"))
    again = ask(server, image_part(None, "photo-1"))  # no data: served from the live segment and the prefix cache
    assert again[:2] == (text, prompt) and again[2] > 0
    assert ask(server, {"type": "image_url", "uuid": "photo-1"})[:2] == (text, prompt)  # image_url left out
    # Settings apply to a named part too: the pixel range of the first sending is the one the server holds.
    small = ask(server, image_part(IMAGE, "photo-1"), mm_processor_kwargs={"max_pixels": 112 * 112})
    assert small[1] < prompt
    assert ask(server, image_part(None, "photo-1"), mm_processor_kwargs={"max_pixels": 112 * 112})[:2] == small[:2]
    err = refused(server, image_part(None, "never-sent"))
    assert param(err) == "messages[0].content[0].uuid" and "never-sent" in err.message
    # Unused for longer than --shm-retain-idle-s, the retained segment is unlinked (checked every 0.25 s): the
    # uuid names no pixels here any more. (Each naming is a use, so nothing asks in between.)
    time.sleep(IDLE_S + 1.5)
    err = refused(server, image_part(None, "photo-1"))
    assert param(err) == "messages[0].content[0].uuid" and "photo-1" in err.message
    assert ask(server, image_part(IMAGE, "photo-1"))[:2] == (text, prompt)  # resent with data: served again


def test_a_uuid_names_a_video_with_its_settings(server: LiveServer) -> None:
    kwargs = {"mm_processor_kwargs": {"fps": 4}}
    text, prompt, _ = ask(server, video_part(VIDEO, "clip-1"), **kwargs)
    assert ask(server, video_part(VIDEO, "clip-1"))[1] < prompt  # 2 frames a second by default: fewer groups
    named = ask(server, video_part(None, "clip-1"), **kwargs)
    assert named[:2] == (text, prompt) and named[2] > 0


def test_a_uuid_with_other_data_maps_to_the_new_data(server: LiveServer) -> None:
    other = png_bytes(200, 280, seed=32)
    ask(server, image_part(IMAGE, "swap"))
    fresh = ask(server, image_part(other, "swap"))
    assert ask(server, image_part(None, "swap"))[:2] == fresh[:2]


@pytest.mark.parametrize(("part", "kwargs", "where"), [
    ({"type": "image_url", "image_url": None}, None, "messages[0].content[0].image_url"),
    ({"type": "image_url", "image_url": None, "uuid": ""}, None, "messages[0].content[0].uuid"),
    (None, {"min_pixels": 0}, "mm_processor_kwargs.min_pixels"),
    (None, {"max_pixels": "big"}, "mm_processor_kwargs.max_pixels"),
    (None, {"min_pixels": 20000, "max_pixels": 10000}, "mm_processor_kwargs.max_pixels"),
    (None, {"max_pixels": 1000}, "mm_processor_kwargs.max_pixels"),  # below the checkpoint's min_pixels
    (None, {"fps": 0}, "mm_processor_kwargs.fps"),
    (None, {"fps": 2, "num_frames": 8}, "mm_processor_kwargs.num_frames"),
    (None, {"num_frames": 2.5}, "mm_processor_kwargs.num_frames"),
    (None, {"do_sample_frames": "yes"}, "mm_processor_kwargs.do_sample_frames"),
    (None, {"do_sample_frames": False, "fps": 1}, "mm_processor_kwargs.fps"),
    (None, {"size": {"longest_edge": 1000}}, "mm_processor_kwargs.size"),
])
def test_bad_media_fields_are_400s_naming_them(
    server: LiveServer, part: dict[str, Any] | None, kwargs: dict[str, Any] | None, where: str
) -> None:
    extra = {"mm_processor_kwargs": kwargs} if kwargs is not None else {}
    assert param(refused(server, part or image_part(IMAGE), **extra)) == where
