"""vLLM's render routes (/v1/chat/completions/render, /v1/completions/render) on the real server: the token ids are
transformers' own processor output (image tokens as the model's image_token_id), the media identifiers are the ids
the generation path names images by, errors are the chat endpoint's 4xx, and a render leaves nothing behind: no
shared memory, no work for the scheduler."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from transformers import AutoProcessor

from tests.server.live import LiveServer, data_url, image_message, png_bytes
from workers.engine.prompt.processor import MMProcessor

CHAT, COMPLETION = "/v1/chat/completions/render", "/v1/completions/render"
PNGS = [png_bytes(64, 48, seed=1), png_bytes(40, 72, seed=2)]


@pytest.fixture(scope="module")
def processor(demo_model_dir: Path) -> Any:
    return AutoProcessor.from_pretrained(str(demo_model_dir))


def post(live: LiveServer, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(live.base + path, json=body, timeout=60, **kw)


def runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of ``token`` in ``ids``."""
    out: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == token:
            if out and out[-1][0] + out[-1][1] == i:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((i, 1))
    return out


def transformers_ids(processor: Any, content: str | list[dict[str, Any]]) -> list[int]:
    """The checkpoint's own processor's prompt for one user turn (image tokens expanded to each image's size)."""
    ids = processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    return list(ids[0] if isinstance(ids[0], list) else ids)


def test_chat_render_is_transformers_prompt_with_the_generation_ids(
    live: LiveServer, processor: Any, demo_model_dir: Path
) -> None:
    before = live.settled_stats()
    held = set(live.segments())  # the shared server may retain earlier modules' images
    text = "Compare the two scans."
    got = post(live, CHAT, {"model": "demo", "messages": image_message(text, [data_url(raw) for raw in PNGS])})
    assert got.status_code == 200, got.text
    rendered = got.json()
    parts: list[dict[str, Any]] = [{"type": "image", "image": Image.open(io.BytesIO(b)).convert("RGB")} for b in PNGS]
    parts.append({"type": "text", "text": text})
    assert rendered["token_ids"] == transformers_ids(processor, parts)
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    spans = [{"offset": o, "length": n} for o, n in runs(rendered["token_ids"], image_id)]
    # The identifiers are the content hashes the generation path (caches, KV-cache events) names these images by.
    ours = MMProcessor(demo_model_dir)
    assert rendered["features"] == {
        "mm_hashes": {"image": [ours.media_hash(raw).hex() for raw in PNGS]},
        "mm_placeholders": {"image": spans},
        "kwargs_data": None,
    }
    assert rendered["model"] == "demo" and rendered["request_id"].startswith("chatcmpl-")
    assert "max_tokens" in rendered["sampling_params"]
    # The same image twice: two items, one identifier; a text-only chat: no features, as vLLM answers.
    twice = post(live, CHAT, {"model": "demo", "messages": image_message("Again?", [data_url(PNGS[0])] * 2)}).json()
    assert twice["features"]["mm_hashes"]["image"] == [ours.media_hash(PNGS[0]).hex()] * 2
    plain = post(live, CHAT, {"model": "demo", "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert plain["features"] is None
    assert plain["token_ids"] == transformers_ids(processor, "Hi")
    # Nothing was left in shared memory and nothing reached the scheduler (its counters arrive every 0.25 s).
    assert set(live.segments()) <= held
    after = live.stats_when("prompt_tokens", before["prompt_tokens"] + 1, timeout=0.6)
    assert (after["prompt_tokens"], after["steps"]) == (before["prompt_tokens"], before["steps"])
    # Renders are not generations: the request counters leave them out (llm-d renders every request first).
    assert after["requests"] == before["requests"]


def test_completions_render_one_entry_per_prompt(live: LiveServer, processor: Any) -> None:
    tok = processor.tokenizer
    one = post(live, COMPLETION, {"model": "demo", "prompt": "The total is"})
    assert one.status_code == 200, one.text
    [rendered] = one.json()
    assert rendered["token_ids"] == tok.encode("The total is") and rendered["features"] is None
    batch = post(live, COMPLETION, {"model": "demo", "prompt": ["a b", [11, 12, 13]], "max_tokens": 3}).json()
    assert [r["token_ids"] for r in batch] == [tok.encode("a b"), [11, 12, 13]]
    assert [r["sampling_params"]["max_tokens"] for r in batch] == [3, 3]


def test_bad_renders_are_the_chat_endpoints_4xx(live: LiveServer) -> None:
    held = set(live.segments())
    image = image_message("What?", ["data:image/png;base64,bm90IGFuIGltYWdl"])
    for path, body, status, param in [
        (CHAT, {"model": "demo"}, 400, "messages"),
        (CHAT, {"model": "gpt-9", "messages": [{"role": "user", "content": "a"}]}, 404, "model"),
        (CHAT, {"model": "demo", "messages": image}, 400, "messages[0].content[0].image_url"),
        (CHAT, {"model": "demo", "messages": [{"role": "user", "content": "a"}], "max_tokens": 0}, 400, "max_tokens"),
        (COMPLETION, {"model": "demo", "prompt": ""}, 400, "prompt"),
    ]:
        response = post(live, path, body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (body, error)
    as_text = httpx.post(live.base + CHAT, content=b"{}", headers={"content-type": "text/plain"}, timeout=30)
    assert as_text.status_code == 400
    assert set(live.segments()) <= held


def test_a_media_uuid_is_its_identifier(live: LiveServer) -> None:
    """(Last in the module: its generation leaves a segment the other tests would see.) A part's uuid names it; a
    render records nothing, so a uuid first seen by a render cannot be named later
    without its bytes (a 400 naming it), while one a generation recorded renders from its live segment."""
    part = {"type": "image_url", "image_url": {"url": data_url(PNGS[0])}, "uuid": "scan-0042"}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]
    rendered = post(live, CHAT, {"model": "demo", "messages": messages})
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["features"]["mm_hashes"] == {"image": ["scan-0042"]}
    named = [{"role": "user", "content": [{"type": "image_url", "uuid": "scan-0042"}, {"type": "text", "text": "And?"}]}]
    refused = post(live, CHAT, {"model": "demo", "messages": named})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages[0].content[0].uuid"
    chat = {"model": "demo", "messages": messages, "max_tokens": 1}
    assert post(live, "/v1/chat/completions", chat).status_code == 200  # a generation records the uuid
    again = post(live, CHAT, {"model": "demo", "messages": named})
    assert again.status_code == 200, again.text
    first = rendered.json()
    got = again.json()
    assert got["features"]["mm_hashes"] == {"image": ["scan-0042"]}
    assert got["features"]["mm_placeholders"] == first["features"]["mm_placeholders"]
