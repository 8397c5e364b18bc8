"""Test videos made in the test (PyAV, a few seconds, odd sizes and frame counts) and transformers'
answer for prompts holding them: its own PyAV reader, its video processor's sampling, its processor and
``generate``."""

from __future__ import annotations

import io
from functools import partial
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.video_utils import read_video_pyav

from workers.engine.prompt.video_prompt import DEFAULT_FPS


def make_video(
    frames: int = 37,
    width: int = 206,
    height: int = 118,
    fps: int = 10,
    *,
    codec: str = "libx264",
    container: str = "mp4",
    gop: int = 8,
    seed: int = 0,
) -> bytes:
    """A moving noise pattern (every frame different), encoded with keyframes every ``gop`` frames."""
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = gop
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "crf": "20"}
        for i in range(frames):
            image = np.roll(base, 7 * i, axis=1)
            image[: (5 * i) % height, :, i % 3] = 255 - 40 * (i % 5)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def video_chat(text: str, videos: list[Any], images: list[Image.Image] | None = None) -> list[dict[str, Any]]:
    """One user turn for the offline Engine: images, then videos (``{"type": "video", "video": ...}``), then text."""
    parts: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images or []]
    parts += [{"type": "video", "video": v} for v in videos]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


class VideoReference:
    """transformers on the same checkpoint: decodes with its own PyAV reader and samples with the video
    processor's ``sample_frames`` at the rate glimpse uses."""

    def __init__(self, model_dir: Path) -> None:
        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        vp = self.processor.video_processor
        self.fps = float(vp.fps) if getattr(vp, "fps", None) else DEFAULT_FPS

    def inputs(self, messages: list[dict[str, Any]]) -> Any:
        images: list[Image.Image] = []
        frames: list[np.ndarray] = []
        metadata: list[Any] = []
        template: list[dict[str, Any]] = []
        for message in messages:
            parts = []
            for part in message["content"]:
                if part["type"] == "video":
                    video, meta = read_video_pyav(
                        io.BytesIO(part["video"]), partial(self.processor.video_processor.sample_frames, fps=self.fps)
                    )
                    frames.append(video)
                    metadata.append(meta)
                    parts.append({"type": "video"})
                elif part["type"] == "image":
                    images.append(part["image"])
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            template.append({**message, "content": parts})
        text = self.processor.apply_chat_template(template, tokenize=False, add_generation_prompt=True)
        return self.processor(
            text=[text],
            images=images or None,
            videos=frames or None,
            video_metadata=metadata or None,
            do_sample_frames=False,
            cap_pixels_per_frame=False,
            return_tensors="pt",
        )

    def generate(self, messages: list[dict[str, Any]], max_new_tokens: int = 12) -> list[int]:
        inputs = self.inputs(messages)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]
