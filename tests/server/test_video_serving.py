"""Video through the real server and the official openai client: answers equal transformers' generate
(Qwen2.5-VL and Qwen3-VL demo checkpoints, with an image, chunks that split frame groups), data:, file:// and
http(s) sources alike, a resent video costs no decode and no encode, and every cap or bad file is its own
400 in OpenAI's shape, the server healthy after and no shared memory left behind."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.media_server import MediaServer
from tests.server.live import LiveServer, data_url, png_bytes
from tests.videos import VideoReference, make_video

MAX_NEW = 10
VIDEO = make_video(frames=37, width=206, height=118, fps=10)  # 3.7 s: 3 (Qwen2.5-VL) or 4 (Qwen3-VL) groups
LONG = make_video(frames=61, width=98, height=62, fps=5, seed=1)  # 12.2 s, 12 groups
IMAGE = png_bytes(123, 77, seed=9)


def video_url(raw: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def user(text: str, videos: list[str], images: list[str] | None = None) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in images or []]
    parts += [{"type": "video_url", "video_url": {"url": u}} for u in videos]
    parts.append({"type": "text", "text": text})
    return {"role": "user", "content": parts}


def reference_messages(text: str, videos: list[bytes], images: list[bytes] | None = None) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image", "image": Image.open(io.BytesIO(b)).convert("RGB")} for b in images or []]
    parts += [{"type": "video", "video": v} for v in videos]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def ask(server: LiveServer, messages: list[dict[str, Any]]) -> str:
    resp = server.client(timeout=120).chat.completions.create(
        model="demo", messages=messages, max_tokens=MAX_NEW, temperature=0  # type: ignore[arg-type]
    )
    return resp.choices[0].message.content or ""


def tokenizer_stats(server: LiveServer) -> dict[str, int]:
    [tok] = server.stats()["tokenizers"]
    return {k: int(v) for k, v in tok.items()}


def settle(server: LiveServer) -> None:
    """Wait until the counters the server reports have caught up (they are pushed periodically)."""
    last: Any = None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        now = (server.stats()["images_encoded"], tokenizer_stats(server))
        if now == last:
            return
        last = now
        time.sleep(0.6)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("videos")
    (root / "clip.mp4").write_bytes(VIDEO)
    return root


@pytest.fixture(scope="module")
def origin() -> Iterator[MediaServer]:
    server = MediaServer(VIDEO)  # serves the video's bytes at /img.png
    yield server
    server.close()


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def served(request: pytest.FixtureRequest, media_dir: Path, origin: MediaServer) -> Iterator[tuple[LiveServer, VideoReference]]:
    model_dir = Path(request.getfixturevalue("demo_model_dir" if request.param == "qwen2_5_vl" else "qwen3_model_dir"))
    server = LiveServer(
        model_dir, "--tokenizer-workers", "1", "--chunk-size", "16", "--lone-prefill-tokens", "0",
        "--allowed-local-media-path", str(media_dir), "--allow-private-media-addresses", "*",
        "--max-videos-per-request", "2", "--max-video-seconds", "15", "--max-video-frames", "40",
        "--max-video-mb", "1",
    )
    yield server, VideoReference(model_dir)
    assert server.stop() == 0, server.output()
    assert server.segments() == []


def expected(reference: VideoReference, messages: list[dict[str, Any]]) -> str:
    tokens = reference.generate(messages, MAX_NEW)
    return str(reference.processor.decode(tokens, skip_special_tokens=True))


def test_video_and_image_equal_transformers(served: tuple[LiveServer, VideoReference]) -> None:
    server, reference = served
    text = "What happens in the clip and the picture?"
    got = ask(server, [user(text, [video_url(VIDEO), video_url(LONG)], [data_url(IMAGE)])])
    assert got == expected(reference, reference_messages(text, [VIDEO, LONG], [IMAGE]))


def test_file_and_http_sources_answer_alike(
    served: tuple[LiveServer, VideoReference], media_dir: Path, origin: MediaServer
) -> None:
    server, reference = served
    text = "Describe it."
    want = expected(reference, reference_messages(text, [VIDEO]))
    assert ask(server, [user(text, [f"file://{media_dir / 'clip.mp4'}"])]) == want
    assert ask(server, [user(text, [f"http://127.0.0.1:{origin.port}/img.png"])]) == want


def test_resent_video_is_not_decoded_or_encoded_again(served: tuple[LiveServer, VideoReference]) -> None:
    server, reference = served
    clip = make_video(frames=29, width=150, height=90, fps=8, seed=11)  # unseen by the other tests
    first = [user("What moves?", [video_url(clip)])]
    answer = ask(server, first)
    settle(server)
    before_tok, before_enc = tokenizer_stats(server), server.stats()["images_encoded"]
    assert before_tok["videos_decoded"] >= 1
    second = [*first, {"role": "assistant", "content": answer}, user("And then?", [video_url(clip)])]
    ask(server, second)
    settle(server)
    after = tokenizer_stats(server)
    assert after["videos_decoded"] == before_tok["videos_decoded"]  # no decode
    assert after["video_frames_decoded"] == before_tok["video_frames_decoded"]
    assert after["video_groups_reused"] > before_tok["video_groups_reused"]  # every group linked from shm
    assert server.stats()["images_encoded"] == before_enc  # no encode: embedding cache and prefix cache


def _truncated_faststart(tmp: Path) -> bytes:
    path = tmp / "faststart.mp4"
    with av.open(str(path), "w", options={"movflags": "faststart"}) as out:
        # 2 fps: sampling at 2 fps takes every frame, so the one cut short is one the answer needs.
        stream = out.add_stream("libx264", rate=2)
        stream.width, stream.height, stream.pix_fmt = 206, 118, "yuv420p"
        rng = np.random.default_rng(3)
        for _ in range(10):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (118, 206, 3), dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    raw = path.read_bytes()
    return raw[: len(raw) - 300]  # the index promises frames whose bytes are gone


def _gif() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, format="GIF")
    return buf.getvalue()


CAPS: dict[str, tuple[Any, str]] = {
    # name: (video URLs or a callable(tmp) giving them, the error code)
    "too_many_videos": (lambda tmp: [video_url(VIDEO)] * 3, "too_many_videos"),
    "too_long": (lambda tmp: [video_url(make_video(frames=40, width=64, height=64, fps=2))], "video_too_long"),
    "too_many_frames": (
        lambda tmp: [video_url(make_video(frames=140, width=64, height=64, fps=10)), video_url(LONG)],
        "too_many_video_frames",
    ),
    "too_many_bytes": (lambda tmp: [video_url(b"\0" * (1 << 20) + b"x")], "video_too_large"),
    "corrupt": (lambda tmp: [video_url(bytes(range(256)) * 64)], "invalid_video"),
    "truncated": (lambda tmp: [video_url(VIDEO[: len(VIDEO) // 2])], "invalid_video"),
    "truncated_faststart": (lambda tmp: [video_url(_truncated_faststart(tmp))], "invalid_video"),
    "not_a_video_container": (lambda tmp: [video_url(_gif(), "image/gif")], "invalid_video"),
    "file_outside_sandbox": (lambda tmp: ["file:///etc/passwd"], "local_media_not_allowed"),
    "unreachable_url": (lambda tmp: ["http://127.0.0.1:9/none.mp4"], "video_fetch_failed"),
}


@pytest.mark.parametrize("case", list(CAPS))
def test_caps_and_bad_files_are_400(served: tuple[LiveServer, VideoReference], case: str, tmp_path: Path) -> None:
    server, _ = served
    make, code = CAPS[case]
    settle_segments = len(server.segments())
    with pytest.raises(openai.BadRequestError) as err:
        ask(server, [user("Describe.", make(tmp_path))])
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and body.get("code") == code, body
    assert httpx.get(server.base + "/health", timeout=5).status_code == 200
    assert len(server.segments()) <= settle_segments  # a refused video leaves no segment behind


def test_render_is_transformers_prompt_with_video_tokens(served: tuple[LiveServer, VideoReference]) -> None:
    """/v1/chat/completions/render of an image and a video: transformers' input_ids (the video's frame groups as
    video_token_id runs) and one identifier and placeholder range per image and per video (as the KV-cache events name
    them): the video's range runs from its first video token to its last, the text between frame groups inside."""
    server, reference = served
    text = "What happens?"
    body = {"model": "demo", "messages": [user(text, [video_url(VIDEO)], [data_url(IMAGE)])]}
    got = httpx.post(server.base + "/v1/chat/completions/render", json=body, timeout=60)
    assert got.status_code == 200, got.text
    rendered = got.json()
    ids = reference.inputs(reference_messages(text, [VIDEO], [IMAGE]))["input_ids"][0].tolist()
    assert rendered["token_ids"] == ids
    tokenizer = reference.processor.tokenizer
    spans = rendered["features"]["mm_placeholders"]
    for modality, token in (("image", reference.processor.image_token), ("video", reference.processor.video_token)):
        token_id = tokenizer.convert_tokens_to_ids(token)
        where = [i for i, t in enumerate(ids) if t == token_id]
        assert len(spans[modality]) == len(rendered["features"]["mm_hashes"][modality]) == 1, modality
        span = spans[modality][0]
        assert (span["offset"], span["offset"] + span["length"]) == (where[0], where[-1] + 1), modality
    image_span = spans["image"][0]
    assert image_span["length"] == ids.count(tokenizer.convert_tokens_to_ids(reference.processor.image_token))
