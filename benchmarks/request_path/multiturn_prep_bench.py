"""A multiturn chat's tokenizer time per round: the multiturn bench's requests (one new 1080p JPEG per round, every
earlier image resent as the same data URL, each answer in the history) through one tokenizer's request handling.

`TokenizerWorker.handle` runs the steps the tokenizer process runs (parse, images, prompt, shm), in this process, on
the 7B-shaped processor (a 1080p image is 10,764 patches). Each pass is a new chat with new images. Modes, all in
one invocation, passes interleaved:
- ``before``: every data URL decoded, pixels written as bf16 patch rows (the path before session 14);
- ``resent skip``: resent data URLs not decoded while their image is live (``ImagePrep.encoded``), bf16 rows;
- ``uint8 frames, trimmed``: that, and pixels written as the resized uint8 frame (pixel_frames.py), with the heap
  trimmed after each body over 4 MB and no Pillow block cache: the server's path before session 18;
- ``uint8 frames``: the server's path: no trim between back-to-back rounds (IdleTrim), Pillow keeping blocks.

    python -m benchmarks.request_path.multiturn_prep_bench --rounds 8 --passes 3
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.args import parser
from benchmarks.checkpoints import processor_checkpoint
from benchmarks.serving.bench_plot import image_data_url, random_text, user_message
from ipc.launch import new_launch_id
from ipc.requests import GenerateRequest
from ipc.shm import sweep
from server.config import ServerConfig
from workers.engine.config import EngineConfig
from workers.tokenizer.media.image_io import Encoded
from workers.tokenizer.media.image_prep import core_share
from workers.tokenizer.service import trim_memory
from workers.tokenizer.worker import TokenizerWorker

MODES = ("before", "resent skip", "uint8 frames, trimmed", "uint8 frames")


def one_chat(model: Path, mode: str, rounds: int, seed: int, threads: int) -> list[float]:
    """ms per round of one chat on a fresh tokenizer (its own launch id, so nothing is shared between passes)."""
    engine = EngineConfig(model=str(model), max_model_len=32768, dtype="bfloat16")
    config = ServerConfig(engine, new_launch_id(), "demo", tokenizer_workers=1, max_images_per_request=64,
                          tokenizer_threads=threads)
    worker = TokenizerWorker(config, 0, logging.getLogger("bench"))
    if mode == "before":  # every data URL decoded, as before
        worker.prep.encoded = lambda url, load: Encoded(load())  # type: ignore[method-assign]
    trimmed = mode != "uint8 frames"
    Image.core.set_blocks_max(0 if trimmed else core_share(config) + 1)  # as run_tokenizer sets it
    if not mode.startswith("uint8 frames"):  # bf16 rows from the normalised frame, as before
        worker.processor.__dict__["uint8_frames"] = None
        worker.prep.frame_layout = None
    rng = np.random.default_rng(seed)
    urls = [image_data_url(1920, 1080, (seed, 2, r), "jpeg") for r in range(rounds)]
    history: list[dict[str, object]] = []
    times = []
    try:
        for r in range(rounds):
            history.append(user_message([urls[r]], random_text(rng, 32)))
            body = json.dumps({"model": "demo", "messages": history, "max_tokens": 16, "stream": True}).encode()
            t0 = time.perf_counter()
            result = worker.handle(GenerateRequest(f"r{r}", memoryview(body), time.time()))
            times.append((time.perf_counter() - t0) * 1e3)
            assert isinstance(result, tuple), result
            if trimmed and len(body) > 4 << 20:  # what the server did after each body over 4 MB
                trim_memory()
            history.append({"role": "assistant", "content": random_text(rng, 12)})
    finally:
        worker.close()
        sweep(config.launch_id)
    return times


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--passes", type=int, default=3, help="chats per mode (interleaved); the table shows medians")
    ap.add_argument("--threads", type=int, default=0, help="the tokenizer's image threads (0: its cores' share)")
    args = ap.parse_args()
    with processor_checkpoint() as model:
        runs: dict[str, list[list[float]]] = {m: [] for m in MODES}
        for p in range(args.passes):
            for mode in MODES:
                runs[mode].append(one_chat(model, mode, args.rounds, 100 + p, args.threads))
    print(f"\ntokenizer ms per round, median of {args.passes} chats; torch threads {torch.get_num_threads()}")
    print(f"{'round':>5} {'images':>6} " + " ".join(f"{m:>22}" for m in MODES))
    for r in range(args.rounds):
        cells = " ".join(f"{statistics.median(run[r] for run in runs[m]):>22.1f}" for m in MODES)
        print(f"{r + 1:>5} {r + 1:>6} {cells}")


if __name__ == "__main__":
    main()
