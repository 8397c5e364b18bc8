"""What the demo-checkpoint tests of every family share: the files a demo checkpoint holds and greedy generation
through transformers from one user turn of images and text."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

# Every family's demo writes these; a family may add more (Qwen3-VL's video preprocessor settings).
DEMO_FILES = {
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def chat_inputs(processor: Any, images: list[Image.Image], text: str = "What does the chart show?") -> Any:
    """The processor's model inputs for one user turn: the images, then the text, and the generation prompt."""
    parts: list[dict[str, Any]] = [{"type": "image", "image": im} for im in images]
    parts.append({"type": "text", "text": text})
    return processor.apply_chat_template(
        [{"role": "user", "content": parts}],
        tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt",
    )


def greedy(processor: Any, model: Any, images: list[Image.Image], max_new_tokens: int) -> tuple[list[int], Any]:
    """transformers' greedy answer (its new token ids) to ``chat_inputs``, and those inputs."""
    inputs = chat_inputs(processor, images)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return [int(t) for t in out[0, inputs["input_ids"].shape[1] :]], inputs
