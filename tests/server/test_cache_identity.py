"""Cache identity cannot collide: two different images whose pad values are equal (found here the way an
attacker would, by trying images until two 30-bit pad values meet) are each answered exactly as transformers
answers them, one after the other, with prefix caching on. Their prompts are token-for-token identical, so
only the image's full content hash in the prefix-cache key keeps the second from reusing the first's KV."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from tests.server.live import LiveServer, data_url, image_message
from workers.engine.prompt.media_items import pad_value
from workers.engine.prompt.processor import MMProcessor

MAX_NEW = 12
TEXT = "Describe this small picture in as much detail as you can, please, for me."


def colliding_pair(processor: MMProcessor, tries: int = 400_000) -> tuple[bytes, bytes]:
    """Two different same-size PNGs whose pad values collide (birthday search over 2^30 values: ~41k tries)."""
    seen: dict[int, bytes] = {}
    rng = np.random.default_rng(1234)
    for _ in range(tries):
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)  # a wholly different image each try
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG", compress_level=0)
        raw = buf.getvalue()
        pad = pad_value(processor.media_hash(raw))
        if pad in seen:
            return seen[pad], raw
        seen[pad] = raw
    raise AssertionError("no collision found")


def reference_text(model_dir: Path, raw: bytes) -> str:
    processor = AutoProcessor.from_pretrained(str(model_dir))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    image = Image.open(io.BytesIO(raw)).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": TEXT}]}]
    inputs = processor.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return str(processor.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))


@pytest.fixture(scope="module")
def server(demo_server: LiveServer) -> LiveServer:
    return demo_server


def test_colliding_pad_values_never_share_kv(server: LiveServer, demo_model_dir: Path) -> None:
    processor = MMProcessor(demo_model_dir)
    first, second = colliding_pair(processor)
    assert first != second
    # The attacker's goal: identical prompt tokens for two different images.
    prompts = []
    for raw in (first, second):
        image = processor.process_image(Image.open(io.BytesIO(raw)), processor.media_hash(raw))
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
        prompts.append(processor.build(processor.render(messages), [image]).input_ids)
    assert prompts[0] == prompts[1] and len(prompts[0]) >= 48  # the image sits inside full, shareable blocks
    encoded_before = server.settled_stats()["images_encoded"]
    client = server.client(timeout=120)
    answers = []
    for raw in (first, second):
        resp = client.chat.completions.create(
            model="demo", messages=image_message(TEXT, [data_url(raw)]),  # type: ignore[arg-type]
            max_tokens=MAX_NEW, temperature=0,
        )
        answers.append(resp.choices[0].message.content)
    expected = [reference_text(demo_model_dir, first), reference_text(demo_model_dir, second)]
    assert expected[0] != expected[1]  # the images really lead to different answers
    assert answers == expected
    assert server.settled_stats()["images_encoded"] == encoded_before + 2
