"""/v1/completions with SGLang's ``image_data`` beside the prompt (what ``sglang.bench_serving --backend sglang-oai``
sends with an image dataset), through the real server: served as /generate serves it (the same tokens), answered in
the completions shape, and refused in the completions body's own names."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest

from tests.server.live import LiveServer, data_url, png_bytes

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def prompt(images: int) -> str:
    """The processor's chat template written client-side, one placeholder per image (bench_serving's image datasets)."""
    return f"<|im_start|>user\n{IMAGE * images}What is on the page?<|im_end|>\n<|im_start|>assistant\n"


def sglang_oai(images: list[str], **extra: Any) -> dict[str, Any]:
    """bench_serving's ``sglang-oai`` body (async_request_openai_completions), its images in image_data."""
    return {"model": "demo", "prompt": prompt(len(images)), "best_of": 1, "max_tokens": 8, "stream": False,
            "temperature": 0.0, "ignore_eos": False, "image_data": images, **extra}


def completions(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base + "/v1/completions", json=body, timeout=60)


def generate(server: LiveServer, text: str, images: list[str]) -> dict[str, Any]:
    resp = httpx.post(server.base + "/generate", timeout=60, json={
        "text": text, "image_data": images, "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def test_image_data_is_served_as_generate_serves_it(live: LiveServer) -> None:
    """One and two images: the answer /generate gives the same prompt and images (its text, finish reason and token
    counts), and prompt_tokens counting each image's tokens."""
    first, second = data_url(png_bytes(96, 64, seed=5)), data_url(png_bytes(64, 64, seed=6))
    text_only = completions(live, {**sglang_oai([]), "prompt": prompt(0)}).json()["usage"]["prompt_tokens"]
    image_tokens = []  # each request's prompt tokens past the text's, less each image's start and end tokens
    for images in ([first], [second], [first, second]):
        resp = completions(live, sglang_oai(images))
        assert resp.status_code == 200, resp.text
        out = resp.json()
        native = generate(live, prompt(len(images)), images)
        [choice] = out["choices"]
        assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
        assert choice["text"] == native["text"] and choice["finish_reason"] == native["meta_info"]["finish_reason"]["type"]
        usage = out["usage"]
        assert usage["prompt_tokens"] == native["meta_info"]["prompt_tokens"]
        assert usage["completion_tokens"] == native["meta_info"]["completion_tokens"] == len(native["output_ids"])
        image_tokens.append(usage["prompt_tokens"] - text_only - 2 * len(images))
    # Every image's span is counted: each has its tokens (a 96x64 image more than a 64x64 one), and two add up.
    assert image_tokens[0] > image_tokens[1] >= 4 and image_tokens[2] == image_tokens[0] + image_tokens[1]
    # Bare base64, as SGLang takes it: the same image, the same answer.
    bare = base64.b64encode(png_bytes(96, 64, seed=5)).decode()
    assert completions(live, sglang_oai([bare])).json()["choices"][0]["text"] == generate(live, prompt(1), [first])["text"]


def test_image_data_streams_and_takes_logprobs_and_echo(live: LiveServer) -> None:
    image = [data_url(png_bytes(96, 64, seed=5))]
    whole = completions(live, sglang_oai(image, logprobs=2)).json()
    [choice] = whole["choices"]
    assert len(choice["logprobs"]["tokens"]) == whole["usage"]["completion_tokens"]
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    body = sglang_oai(image, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", live.base + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line.removeprefix("data: ") for line in resp.iter_lines() if line.strip()]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    echoed = completions(live, sglang_oai(image, echo=True)).json()["choices"][0]["text"]
    assert echoed == prompt(1) + choice["text"]


SMALL = data_url(png_bytes(32, 32, seed=1))


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"image_data": [SMALL, "data:image/png;base64,iVBORw0KGgo="]}, "image_data[1]"),  # not an image
        ({"image_data": [SMALL, SMALL]}, "image_data"),  # one placeholder, two images
        ({"prompt": prompt(2)}, "image_data"),  # two placeholders, one image
        ({"prompt": [prompt(1), prompt(1)]}, "image_data"),  # a batch of prompts cannot share the images
        ({"prompt": [1, 2, 3]}, "image_data"),  # token ids: no placeholder to expand
        ({"image_data": [SMALL, 5]}, "image_data"),
        ({"echo": True, "logprobs": 1}, "echo"),  # the prompt's log probabilities are not computed over images
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"echo": True, "max_tokens": 0}, "max_tokens"),
    ],
)
def test_image_data_refusals_name_the_field(live: LiveServer, change: dict[str, Any], param: str) -> None:
    resp = completions(live, {**sglang_oai([SMALL]), **change})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and "messages" not in error["message"], error


def test_image_data_renders_as_it_is_served(live: LiveServer) -> None:
    """vLLM's completions render of the same body: the prompt it is served with, its image among the features."""
    image = [data_url(png_bytes(96, 64, seed=5))]
    resp = httpx.post(live.base + "/v1/completions/render", json=sglang_oai(image), timeout=60)
    assert resp.status_code == 200, resp.text
    [rendered] = resp.json()
    served = completions(live, sglang_oai(image)).json()
    assert len(rendered["token_ids"]) == served["usage"]["prompt_tokens"]
    assert len(rendered["features"]["mm_hashes"]["image"]) == 1
    refused = httpx.post(live.base + "/v1/completions/render", json=sglang_oai(image, prompt=prompt(2)), timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "image_data"
