"""vLLM's ``return_token_ids`` through the real server and the official openai client (extra_body), on the demo
checkpoint: the prompt's ids are the ones transformers' template and tokenizer give, each choice's generated ids are
transformers' greedy tokens, whole or streamed (the prompt's on the first chunk, each chunk's own ids after), on chat
and completions (a batch: each choice its own prompt's); without it no answer carries the keys."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.reference import HFReference
from tests.server.live import LiveServer, data_url, png_bytes

MAX_NEW = 8
MESSAGES: Any = [{"role": "user", "content": "Read the invoice total."}]
IDS: Any = {"return_token_ids": True}


def test_chat_whole_and_streamed(live: LiveServer, ref: HFReference) -> None:
    prompt = ref.prompt_ids(MESSAGES)
    expected, _ = ref.greedy(prompt, MAX_NEW)
    client = live.client()
    whole = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=MAX_NEW, temperature=0,
                                           extra_body=IDS)  # fmt: skip
    body = whole.model_dump()
    assert body["prompt_token_ids"] == prompt and body["choices"][0]["token_ids"] == expected
    chunks = [c.model_dump() for c in client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=MAX_NEW, temperature=0, extra_body=IDS, stream=True)]
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c or c["prompt_token_ids"] is None
                                                           for c in chunks[1:])  # fmt: skip
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == expected
    plain = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=MAX_NEW, temperature=0)
    assert "prompt_token_ids" not in (plain.model_extra or {}) and "token_ids" not in (plain.choices[0].model_extra or {})


def test_an_image_prompts_ids_hold_the_checkpoints_image_token(live: LiveServer, ref: HFReference) -> None:
    image = png_bytes(64, 48, seed=77)
    messages: Any = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                  {"type": "text", "text": "What is it?"}]}]  # fmt: skip
    out = live.client().chat.completions.create(model="demo", messages=messages, max_tokens=2, temperature=0,
                                                extra_body=IDS)  # fmt: skip
    pad = ref.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = out.model_dump()["prompt_token_ids"]
    assert out.usage is not None and len(ids) == out.usage.prompt_tokens and ids.count(pad) > 1
    # The render route's token_ids, which its own tests hold to transformers' processor.
    body = {"model": "demo", "messages": messages, "max_tokens": 2}
    rendered = httpx.post(live.base + "/v1/chat/completions/render", json=body, timeout=60).json()
    assert rendered["token_ids"] == ids


def test_completions_whole_streamed_and_batched(live: LiveServer, ref: HFReference) -> None:
    texts = ["Read the invoice total.", "Add the seven rows."]
    prompts = [ref.tokenizer(t)["input_ids"] for t in texts]
    expected = [ref.greedy(p, MAX_NEW)[0] for p in prompts]
    body = {"model": "demo", "prompt": texts, "max_tokens": MAX_NEW, "temperature": 0, "return_token_ids": True}
    batch = httpx.post(live.base + "/v1/completions", json=body, timeout=60).json()
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in batch["choices"]] == list(zip(prompts, expected, strict=True))
    with httpx.stream("POST", live.base + "/v1/completions", json={**body, "prompt": texts[0], "stream": True},
                      timeout=60) as resp:  # fmt: skip
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    choices = [c for e in events for c in e["choices"]]
    assert choices[0]["prompt_token_ids"] == prompts[0] and all("prompt_token_ids" not in c for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == expected[0]
    plain = httpx.post(live.base + "/v1/completions", json={**body, "return_token_ids": None}, timeout=60).json()
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain["choices"])
