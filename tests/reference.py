"""transformers as the reference for what the server samples: prompt ids from the checkpoint's own chat
template, next-token logits of a whole sequence, and a greedy loop over a logits-processing function
written the slow, obvious way (so the server's batched processing is checked against it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

Process = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]  # (logits, prompt, output) -> logits


class HFReference:
    def __init__(self, model_dir: Path) -> None:
        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.tokenizer = self.processor.tokenizer
        self.model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids: list[int] = list(eos) if isinstance(eos, list) else [eos]

    def prompt_ids(self, messages: list[dict[str, Any]], **template: Any) -> list[int]:
        out = self.processor.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True, **template
        )
        ids = out["input_ids"]
        return [int(t) for t in (ids[0] if ids and isinstance(ids[0], list) else ids)]

    @torch.inference_mode()
    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """float32 logits [vocab] of the token after ``ids`` (a full forward, no cache: slow and obvious)."""
        out = self.model(input_ids=torch.tensor([ids]))
        return out.logits[0, -1].float()

    def greedy(self, prompt: list[int], max_tokens: int, process: Process | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy tokens (stopping at EOS) and each step's log-softmax after ``process``."""
        out: list[int] = []
        steps: list[torch.Tensor] = []
        for _ in range(max_tokens):
            logits = self.next_logits(prompt + out)
            if process is not None:
                logits = process(logits, prompt, out)
            steps.append(torch.log_softmax(logits, dim=-1))
            token = int(logits.argmax())
            out.append(token)
            if token in self.eos_ids:
                break
        return out, steps

    def text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def penalize(
    *,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    bias: dict[int, float] | None = None,
    min_tokens: int = 0,
    stop_ids: tuple[int, ...] = (),
) -> Process:
    """Reference logits processing, one token at a time: bias, min_tokens, repetition (transformers'
    rule: divide a positive logit, multiply a negative one), then frequency and presence (OpenAI's)."""

    def process(logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
        x = logits.clone()
        for token, value in (bias or {}).items():
            x[token] += value
        if len(output) < min_tokens:
            for token in stop_ids:
                x[token] = float("-inf")
        for token in set(prompt) | set(output):
            x[token] = x[token] / repetition if x[token] > 0 else x[token] * repetition
        for token, count in Counter(output).items():
            x[token] -= frequency * count + presence
        return x

    return process


def greedy_text(model_dir: Path, images: list[bytes], text: str, max_new: int) -> str:
    """transformers' greedy answer (CPU, float32) to one user turn of encoded images then text, decoded as the
    server decodes it (special tokens skipped): the reference for server tests of any family."""
    import io

    from PIL import Image

    processor = AutoProcessor.from_pretrained(str(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    parts: list[dict[str, Any]] = [{"type": "image", "image": Image.open(io.BytesIO(b)).convert("RGB")} for b in images]
    parts.append({"type": "text", "text": text})
    inputs = processor.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=True, add_generation_prompt=True, return_dict=True,
        return_tensors="pt",
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    return str(processor.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))


class ChatReference:
    """transformers' greedy answers (CPU, float32) to whole chats of image turns, decoded as the server decodes them:
    the reference for every turn of a served multi-turn chat. ``processor_kwargs`` go to the processor (e.g. Gemma 4's
    ``processor_kwargs={"max_soft_tokens": 70}``)."""

    def __init__(self, model_dir: Path, max_new: int) -> None:
        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.max_new = max_new

    def answer(self, messages: list[dict[str, Any]], **processor_kwargs: Any) -> str:
        inputs = self.processor.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt",
            **processor_kwargs,
        )
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=self.max_new, do_sample=False)
        return str(self.processor.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
