"""A fresh 1080p JPEG on a tokenizer's critical path, stage by stage, with the variants each stage could take.

Every request with a new image waits for its first one to be decoded, resized to the processor's grid and written
to shm before the prompt reaches the scheduler (round 8 of the multiturn bench: one fresh image behind seven resent
ones). This times each stage alone on this host, median of ``--count`` runs over distinct images, torch's intra-op
threads set as a tokenizer sets them (cores / ``--tokenizers``):

- decode: Pillow into its own storage plus the packed copy the resize reads, against `decode_pixels` (simplejpeg);
- resize: the processor's resize in one call, against `resize_in_strips` (its horizontal pass in row strips on
  ``--strips`` threads, then its vertical pass; the table says whether the bits are equal);
- write: a new segment as the tokenizer writes one (`write_and_publish`), against a copy into a segment allocated
  and faulted in beforehand;
- admit: msgspec decoding a round-8 body (eight 1080p data URLs), and blake3 over its eight URLs;
- gemma4 rows: Gemma 4's patch rows at a budget from decoded pixels, through transformers' processor against
  `Gemma4Images.fast_rows` (the bits are checked equal), and the uint8 frame a tokenizer writes instead (`frame`),
  on one thread and (where the share is over one) in row strips on the tokenizer's resize threads.

    python -m benchmarks.request_path.fresh_image_bench --count 20
"""

from __future__ import annotations

import io
import mmap
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3
import msgspec
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import AutoProcessor

from benchmarks.args import parser
from benchmarks.checkpoints import ensure_demo_model, processor_checkpoint
from benchmarks.serving.bench_plot import encode_image, image_data_url, make_image
from ipc import shm
from ipc.launch import new_launch_id
from workers.engine.config import EngineConfig
from workers.engine.models import load_spec
from workers.engine.models.frame_resize import resize_in_strips
from workers.engine.models.gemma4.processing import Gemma4Images
from workers.engine.prompt.processor import MMProcessor
from workers.tokenizer.media.fetch import decode_image, decode_pixels
from workers.tokenizer.media.image_io import write_and_publish


def median_ms(fn: Callable[[int], Any], count: int) -> float:
    fn(0)  # first use: allocator pages, thread start-up
    times = []
    for i in range(count):
        t0 = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def faulted_segment(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--tokenizers", type=int, default=4, help="the server's --tokenizer-workers (threads = cores / this)")
    ap.add_argument("--strips", type=int, default=0, help="threads for the horizontal pass (0: the tokenizer's share)")
    args = ap.parse_args()
    share = max(1, (os.cpu_count() or 1) // args.tokenizers)
    torch.set_num_threads(share)
    strips = args.strips or share
    images = [encode_image(make_image(1920, 1080, (9, i)), "jpeg") for i in range(args.count + 1)]
    rows: list[tuple[str, str, float]] = []

    rows.append(("decode", "Pillow + packed copy", median_ms(lambda i: np.array(decode_image(images[i], 10**8)), args.count)))
    rows.append(("decode", "decode_pixels", median_ms(lambda i: decode_pixels(images[i], 10**8), args.count)))

    with processor_checkpoint() as model:
        engine = EngineConfig(model=str(model), max_model_len=32768, dtype="bfloat16")
        mm = MMProcessor(engine.model, engine.model_spec())
        frame = mm.process_image(decode_pixels(images[0], 10**8), image_hash=bytes(16), frame=True).pixel_values
    size = (frame.shape[0], frame.shape[1])
    pixels = [torch.from_numpy(np.array(Image.open(io.BytesIO(raw)).convert("RGB"))).permute(2, 0, 1)[None]
              for raw in images[:4]]

    def whole(i: int) -> torch.Tensor:
        return F.interpolate(pixels[i % len(pixels)], size=size, mode="bicubic", antialias=True)

    with ThreadPoolExecutor(strips) as pool:
        same = all(torch.equal(whole(i), resize_in_strips(pixels[i], size, pool, strips)) for i in range(len(pixels)))
        rows.append(("resize", "one call", median_ms(whole, args.count)))
        rows.append(("resize", f"{strips} strips, bits {'equal' if same else 'DIFFER'}",
                     median_ms(lambda i: resize_in_strips(pixels[i % len(pixels)], size, pool, strips), args.count)))

    launch = new_launch_id()
    flat = frame.contiguous()

    def write_new(i: int) -> None:  # the tokenizer's own write: a new segment under a temporary name, published
        ref = shm.ShmRef(shm.segment_name(launch, f"tmp-{i}"), flat.numel(), "uint8", tuple(flat.shape))
        shm.ShmSegment.unlink(write_and_publish(ref, flat, shm.segment_name(launch, f"final-{i}")).name)

    rows.append(("write", "new segment (write_and_publish)", median_ms(write_new, args.count)))
    base = f"/dev/shm/glimpse-bench-{os.getpid()}"
    spares = [faulted_segment(f"{base}-s{i}", flat.numel()) for i in range(args.count + 1)]
    rows.append(("write", "into a faulted-in segment",
                 median_ms(lambda i: torch.frombuffer(spares[i], dtype=torch.uint8).copy_(flat.view(-1)), args.count)))
    for i in range(args.count + 1):
        os.unlink(f"{base}-s{i}")

    urls = [image_data_url(1920, 1080, (5, r), "jpeg") for r in range(8)]
    body = msgspec.json.encode({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": u}}, {"type": "text", "text": "and this one?"}]} for u in urls]})
    rows.append(("admit", f"JSON decode, {len(body) / 1e6:.1f} MB", median_ms(lambda i: msgspec.json.decode(body), args.count)))
    rows.append(("admit", "blake3 of 8 URLs", median_ms(lambda i: [blake3.blake3(u.encode()).digest(16) for u in urls], args.count)))

    gemma_dir = ensure_demo_model(family="gemma4")
    gemma_hf, gemma_spec = AutoProcessor.from_pretrained(gemma_dir), load_spec(gemma_dir)
    gemma = Gemma4Images(gemma_hf, gemma_spec)
    gemma_pool = ThreadPoolExecutor(max(1, strips - 1))
    gemma_strips = Gemma4Images(gemma_hf, gemma_spec, gemma_pool, strips)  # a tokenizer's resize threads
    decoded = [decode_pixels(raw, 10**8) for raw in images[:4]]
    for budget in (280, 1120):
        def processor(i: int, budget: int = budget) -> Any:
            return gemma.processor_rows(Image.fromarray(np.asarray(decoded[i % len(decoded)]), "RGB"), budget)

        def fast(i: int, budget: int = budget) -> Any:
            return gemma.fast_rows(np.asarray(decoded[i % len(decoded)]), budget)

        def served(i: int, budget: int = budget) -> Any:
            return gemma.frame(np.asarray(decoded[i % len(decoded)]), budget)

        def served_strips(i: int, budget: int = budget) -> Any:
            return gemma_strips.frame(np.asarray(decoded[i % len(decoded)]), budget)

        same = all(torch.equal(processor(i)[0], fast(i)[0]) for i in range(len(decoded)))
        rows.append(("gemma4", f"budget {budget}: processor", median_ms(processor, args.count)))
        rows.append(("gemma4", f"budget {budget}: fast_rows, bits {'equal' if same else 'DIFFER'}", median_ms(fast, args.count)))
        rows.append(("gemma4", f"budget {budget}: uint8 frame, one thread", median_ms(served, args.count)))
        if strips > 1:
            same = all(torch.equal(served(i)[0], served_strips(i)[0]) for i in range(len(decoded)))
            rows.append(("gemma4", f"budget {budget}: uint8 frame, {strips} strips, bits {'equal' if same else 'DIFFER'}",
                         median_ms(served_strips, args.count)))

    print(f"\nfresh 1080p JPEG stages: median of {args.count}, {os.cpu_count()} cores, torch threads {share}")
    print(f"{'stage':<8} {'variant':<44} {'ms':>7}")
    for stage, variant, ms in rows:
        print(f"{stage:<8} {variant:<44} {ms:>7.2f}")


if __name__ == "__main__":
    main()
