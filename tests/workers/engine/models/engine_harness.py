"""What the families' offline-Engine exactness tests share: the chat they send, transformers' greedy answer to it on
the same checkpoint (the reference), and an Engine on the CPU in float32 over that checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from ipc.prompts import SamplingParams
from tests.conftest import noise_image
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
ODD_SIZES = [(57, 83), (300, 200), (123, 77), (640, 480), (29, 29)]
FIVE = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(ODD_SIZES)]


def chat(text: str, images: list[Image.Image]) -> list[dict[str, Any]]:
    """One user turn: the images first, then the text."""
    parts: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


class Reference:
    """transformers' own model and processor for a checkpoint directory (CPU, float32)."""

    def __init__(self, model_dir: Path) -> None:
        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def generate(self, messages: list[dict[str, Any]], max_new: int = MAX_NEW) -> list[int]:
        inputs = self.processor.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
        return [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]


def make_engine(model_dir: Path, **overrides: Any) -> Engine:
    args: dict[str, Any] = dict(
        model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=512, block_size=16, lone_prefill_tokens=0
    )
    args.update(overrides)
    return Engine(EngineConfig(**args))
