"""What the engine's exactness tests compare against: transformers' own greedy ``generate`` on a checkpoint, given a
chat through the checkpoint's processor, and the chat of images and a question those tests send both sides."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image


def chat(text: str, images: list[Image.Image]) -> list[dict[str, Any]]:
    """One user turn: the images first, then the text."""
    parts: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def greedy_tokens(processor: Any, model: Any, messages: list[dict[str, Any]], max_new_tokens: int) -> list[int]:
    """The token ids transformers generates greedily after the chat template's generation prompt."""
    inputs = processor.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]
