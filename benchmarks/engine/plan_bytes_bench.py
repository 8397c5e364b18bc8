"""Bytes per step from the scheduler to a model worker, for one request with 16 large images.

A StepPlan carries token ids, KV block ids and shm pointers (`ShmRef`), never pixels, so its size
must follow the number of tokens and images, not the bytes of the images. This script builds the
request the way a tokenizer worker does (`MMProcessor` of the Qwen2.5-VL-7B-shaped checkpoint: real
pixel limits, placeholders built from the real grid), gives every image a ShmRef named like a real
segment (nothing is written to /dev/shm), and drives the scheduler's own `SchedulerCore`
(`workers.scheduler.process.build_core`, chunk_size 1024) through the whole prefill and a few decode steps,
recording `len(msgpack.encode(plan))` for every step: the bytes the scheduler sends each TP rank.

    python -m benchmarks.engine.plan_bytes_bench --resolutions 720p,1080p,2k --images 16 --json plans.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch
from PIL import Image

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from ipc.launch import new_launch_id
from ipc.prompts import MMItem, SamplingParams
from ipc.shm import ShmRef, dtype_name, segment_name
from ipc.steps import StepPlan, StepResult
from server.config import ServerConfig
from workers.engine.config import EngineConfig
from workers.engine.prompt.media_items import ProcessedImage
from workers.engine.prompt.processor import MMProcessor
from workers.scheduler.process import build_core

RESOLUTIONS = {"720p": (1280, 720), "1080p": (1920, 1080), "2k": (2560, 1440)}
_encoder = msgspec.msgpack.Encoder()


@dataclass
class PlanSizes:
    resolution: str
    images: int
    grid: tuple[int, int, int]
    pixel_bytes: int  # of the whole request, in the engine dtype (what sits in shm)
    prompt_tokens: int
    prefill_steps: int
    first_plan_bytes: int  # announces the sequence: every prompt token id and M-RoPE position
    prefill_chunk_median_bytes: float  # later prefill steps: block ids and the encode jobs of the chunk
    max_plan_bytes: int
    decode_plan_bytes: float  # median over the decode steps
    encode_job_bytes: int  # all EncodeJobs of the request (hash, grid, ShmRef per image), summed
    encode_job_bytes_per_image: float
    plan_bytes_total: int  # every step until the last decode step measured
    per_step: list[int]  # encoded size of every plan, in order

    @property
    def first_plan_bytes_per_token(self) -> float:
        return self.first_plan_bytes / self.prompt_tokens

    @property
    def pixel_to_plan_ratio(self) -> float:
        return self.pixel_bytes / self.plan_bytes_total


def build_request(
    processor: MMProcessor, launch_id: str, size: tuple[int, int], images: int, dtype: torch.dtype
) -> tuple[list[int], int, list[MMItem], int]:
    """(input_ids, mrope_delta, items, pixel bytes) as a tokenizer would hand them to the core."""
    width, height = size
    rng = np.random.default_rng(0)
    sample = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    processed = processor.process_image(sample)  # the real grid and pixel shape at this resolution
    rows, row_width = processed.pixel_values.shape
    nbytes = rows * row_width * dtype.itemsize
    placeholders = [
        ProcessedImage(processor.media_hash(f"image-{width}x{height}-{i}".encode()), processed.grid,
                       processed.num_tokens, torch.empty(0))
        for i in range(images)
    ]
    parts = [{"type": "image_url", "image_url": {"url": "data:"}} for _ in range(images)]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare these pages."}]}]
    prompt = processor.build(processor.render(messages), placeholders)
    t, h, w = processed.grid
    items = []
    for k, span in enumerate(prompt.spans):
        # The same name layout as workers/tokenizer/process.py: {hash}-{t}x{h}x{w}-{worker nonce}{counter}.
        name = segment_name(launch_id, f"{span.hash.hex()}-{t}x{h}x{w}-w0a1b2c3-{k + 1:x}")
        ref = ShmRef(name, nbytes, dtype_name(dtype), (rows, row_width))
        items.append(MMItem(span.hash, span.offset, span.length, span.grid, ref))
    return prompt.input_ids, prompt.mrope_delta, items, nbytes * images


def measure(model_dir: Path, processor: MMProcessor, resolution: str, args: argparse.Namespace) -> PlanSizes:
    launch_id = new_launch_id()
    engine = EngineConfig(
        model=str(model_dir), dtype="bfloat16", chunk_size=args.chunk_size, max_model_len=args.max_model_len
    )
    config = ServerConfig(engine=engine, launch_id=launch_id, served_model_name="bench")
    dtype = engine.torch_dtype()
    ids, delta, items, pixel_bytes = build_request(
        processor, launch_id, RESOLUTIONS[resolution], args.images, dtype
    )
    num_blocks = -(-(len(ids) + args.decode_steps + 1) // engine.block_size) + 1
    core = build_core(config, num_blocks)
    sampling = SamplingParams(max_tokens=args.decode_steps + 1, temperature=0.0, ignore_eos=True)
    core.add("r0", ids, delta, items, sampling)
    prefill: list[int] = []
    decode: list[int] = []
    jobs: list[int] = []
    plan: StepPlan | None
    while (plan := core.schedule()) is not None:
        size = len(_encoder.encode(plan))
        is_decode = not plan.new_seqs and all(c.length == 1 and c.start >= len(ids) for c in plan.chunks)
        (decode if is_decode else prefill).append(size)
        jobs += [len(_encoder.encode(job)) for job in plan.encode]
        sampled = [(c.rid, 0) for c in plan.chunks if c.sample]
        core.update(StepResult(plan.step_id, sampled))
        if len(decode) >= args.decode_steps:
            break
    return PlanSizes(
        resolution=resolution,
        images=args.images,
        grid=items[0].grid,
        pixel_bytes=pixel_bytes,
        prompt_tokens=len(ids),
        prefill_steps=len(prefill),
        first_plan_bytes=prefill[0],
        prefill_chunk_median_bytes=statistics.median(prefill[1:]) if len(prefill) > 1 else 0.0,
        max_plan_bytes=max(prefill + decode),
        decode_plan_bytes=statistics.median(decode) if decode else 0.0,
        encode_job_bytes=sum(jobs),
        encode_job_bytes_per_image=sum(jobs) / args.images,
        plan_bytes_total=sum(prefill) + sum(decode),
        per_step=prefill + decode,
    )


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--resolutions", default="720p,1080p,2k", help=f"comma-separated: {', '.join(RESOLUTIONS)}")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=128000)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = shaped_checkpoint(Path(tmp) / "ckpt", "7b")
        processor = MMProcessor(model_dir)
        results = [measure(model_dir, processor, r, args) for r in args.resolutions.split(",")]

    print(f"\n{args.images} images per request, 7B-shaped processor, bf16 pixels, chunk_size {args.chunk_size}; "
          "bytes of msgpack-encoded StepPlan (what every TP rank receives per step)")
    header = (f"{'res':6} {'grid':>12} {'pixel MB':>9} {'tokens':>7} {'steps':>5} {'first plan':>10} {'B/tok':>6} "
              f"{'prefill med':>11} {'max plan':>9} {'decode':>6} {'encode jobs':>11} {'per image':>9} "
              f"{'pixels / all plans':>18}")
    print(header)
    for r in results:
        grid = "x".join(str(g) for g in r.grid)
        print(f"{r.resolution:6} {grid:>12} {r.pixel_bytes / 1e6:>9.1f} {r.prompt_tokens:>7} {r.prefill_steps:>5} "
              f"{r.first_plan_bytes:>10} {r.first_plan_bytes_per_token:>6.1f} {r.prefill_chunk_median_bytes:>11.0f} {r.max_plan_bytes:>9} "
              f"{r.decode_plan_bytes:>6.0f} {r.encode_job_bytes:>11} {r.encode_job_bytes_per_image:>9.0f} "
              f"{r.pixel_to_plan_ratio:>17.0f}x")
    if args.json:
        doc = {
            "args": vars(args) | {"json": str(args.json)},
            "results": [
                asdict(r)
                | {"pixel_to_plan_ratio": r.pixel_to_plan_ratio, "first_plan_bytes_per_token": r.first_plan_bytes_per_token}
                for r in results
            ],
        }
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
