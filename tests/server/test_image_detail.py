"""``detail`` on an image part: "low" scales the image down to 512 px on its longer side before the processor sees it,
so the answer is the one a client gets by resizing the image itself (same prompt tokens, same greedy text), and the
low and full versions of the same bytes are two images to every cache; a bad value, or "low" on a video, is a 400."""

from __future__ import annotations

import io
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.server.live import LiveServer, data_url, png_bytes
from workers.tokenizer.media.fetch import LOW_DETAIL_SIDE, low_detail_size


@pytest.fixture(scope="module")
def server(demo_server: LiveServer) -> LiveServer:
    return demo_server


def _ask(server: LiveServer, raw: bytes, detail: str | None) -> tuple[str, int]:
    image_url: dict[str, Any] = {"url": data_url(raw)}
    if detail is not None:
        image_url["detail"] = detail
    out = server.client().chat.completions.create(
        model="demo", max_tokens=10, temperature=0.0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": image_url},  # type: ignore[misc,list-item]
                                               {"type": "text", "text": "What is in this picture?"}]}],
    )
    assert out.usage is not None
    return out.choices[0].message.content or "", out.usage.prompt_tokens


def test_low_detail_is_the_image_scaled_down_by_the_client(server: LiveServer) -> None:
    raw = png_bytes(900, 600, seed=7)
    size = low_detail_size(900, 600)
    assert max(size) == LOW_DETAIL_SIDE and size == (512, 341)
    buf = io.BytesIO()
    Image.open(io.BytesIO(raw)).convert("RGB").resize(size, Image.Resampling.BICUBIC).save(buf, format="PNG")
    low = _ask(server, raw, "low")  # first, so a full-detail answer below cannot come from its segment or KV
    full = _ask(server, raw, None)
    assert low == _ask(server, buf.getvalue(), None)  # the same pixels, so the same prompt and greedy text
    assert low[1] < full[1]  # fewer image tokens at low detail (the demo processor caps at 448 x 448 pixels)
    assert _ask(server, raw, "high") == full and _ask(server, raw, "auto") == full
    assert _ask(server, raw, "low") == low  # and again, now from the caches
    small = png_bytes(300, 200, seed=8)  # already within 512 px: low detail leaves it as it is
    assert _ask(server, small, "low") == _ask(server, small, None)


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "ultra"}},
     "messages[0].content[0].image_url.detail"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA", "detail": "low"}},
     "messages[0].content[0].video_url.detail"),
])
def test_a_detail_it_cannot_honour_is_a_400_naming_it(server: LiveServer, part: dict[str, Any], param: str) -> None:
    body = {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": [part]}]}
    response = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
