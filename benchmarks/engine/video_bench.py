"""Video: TTFT and peak GPU memory of one request with a long 720p video, per-group encoding vs the
baseline (``--mm-cache-mode request``: the whole video encoded with the first chunk), the second turn with
the same video, and CPU decode speed.

    python -m benchmarks.engine.video_bench --shape 7b --durations 30,120,300 --json video.json
    python -m benchmarks.engine.video_bench --decode-only            # CPU decode frames/s, 720p and 1080p

Videos are made here (PyAV, libx264, smooth moving content at ``--source-fps``) and sampled at 2 fps as the
checkpoint's video processor samples them. The shaped checkpoints use Qwen2.5-VL's / Qwen3-VL's published
video pixel limits with ``cap_pixels_per_frame`` (qwen-vl-utils' total budget), so a 5-minute 720p video
fits the context (~115k tokens on Qwen2.5-VL-7B). Engine rows run in-process (the offline Engine on the GPU,
bf16, dummy weights): ``pre_s`` is decode + processing on the CPU, ``gpu_s`` the rest of the time to the
first token, ``peak_gib`` torch's peak allocation during the request, ``encoded_first_step`` the frame
groups encoded by the first prefill step. The second turn resends the video after the first answer: its
groups come from the embedding cache and its earlier turn from the prefix cache (``vit_groups`` 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch

from benchmarks.args import parser
from benchmarks.checkpoints import edit_processor_configs, shaped_checkpoint
from ipc.prompts import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine
from workers.engine.prompt.video_decode import iter_frames, probe

SIZES = {"720p": (1280, 720), "1080p": (1920, 1080)}
# The video processor limits of the published checkpoints (transformers' defaults for these families).
VIDEO_SIZE = {
    "qwen2_5_vl": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
    "qwen3_vl": {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32 * 2},
}


def make_video(path: Path, seconds: float, size: str, fps: int) -> Path:
    """Smooth content (a moving gradient and bars), so the bitrate is a camera's, not noise's."""
    width, height = SIZES[size]
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "23"}  # keyframes every 250 frames (x264's default)
        for i in range(int(seconds * fps)):
            r = (x + 3 * i) % 256
            g = (y + 2 * i) % 256
            b = ((x + y) / 2 + ((i // fps) % 8) * 32) % 256
            image = np.stack(np.broadcast_arrays(r, g, b), axis=-1).astype(np.uint8)
            image[:, (5 * i) % width : (5 * i) % width + 16] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def decode_rows(tmp: Path, fps: int, seconds: float) -> list[dict[str, Any]]:
    """Frames/s of decoding every frame, and of the seek-to-sampled decode glimpse does (2 fps sampling)."""
    rows = []
    for size in SIZES:
        path = make_video(tmp / f"decode-{size}.mp4", seconds, size, fps)
        raw = path.read_bytes()
        info = probe(raw)
        t0 = time.perf_counter()
        with av.open(str(path)) as container:
            container.streams.video[0].thread_type = "AUTO"
            every = sum(1 for frame in container.decode(video=0) if frame.to_ndarray(format="rgb24") is not None)
        full_s = time.perf_counter() - t0
        step = max(1, round(info.fps / 2))
        indices = list(range(0, info.total_frames, step))
        t0 = time.perf_counter()
        sampled = sum(1 for _ in iter_frames(raw, info, indices))
        sampled_s = time.perf_counter() - t0
        rows.append({
            "size": size, "frames": every, "all_frames_per_s": every / full_s,
            "sampled_frames": sampled, "sampled_frames_per_s": sampled / sampled_s,
            "video_s_per_s": info.duration / sampled_s,
        })
    return rows


def checkpoint(tmp: Path, shape: str, written: Path | None = None) -> Path:
    model_dir = tmp / f"model-{shape}"
    if written is not None:  # written beforehand, e.g. where this machine's transformers cannot write demos
        shutil.copytree(written / shape, model_dir)
    else:
        model_dir = shaped_checkpoint(model_dir, shape)
    family = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    key = "qwen3_vl" if "Qwen3" in family else "qwen2_5_vl"

    def frame_size(target: dict[str, Any]) -> None:
        target["size"] = VIDEO_SIZE[key]
        target.pop("min_pixels", None), target.pop("max_pixels", None)
        target["cap_pixels_per_frame"] = True

    edit_processor_configs(model_dir, ("processor_config.json", "video_preprocessor_config.json"), "video_processor", frame_size)
    return model_dir


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _peak(cuda: bool) -> int:
    return torch.cuda.max_memory_allocated() if cuda else 0


def engine_row(model_dir: Path, video: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device == "cuda"
    engine = Engine(EngineConfig(
        model=str(model_dir), device=args.device, dtype="bfloat16" if cuda else "float32",
        load_format="auto" if args.shape == "demo" else "dummy", chunk_size=args.chunk_size,
        kv_cache_mb=args.kv_cache_mb, mm_cache_mb=args.mm_cache_mb, max_model_len=args.max_model_len,
        mm_cache_mode=mode,  # type: ignore[arg-type]
    ))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    warm = make_video(video.parent / "warm.mp4", 2, "720p", 10)
    engine.generate([[{"role": "user", "content": [{"type": "video", "video": str(warm)}, {"type": "text", "text": "hi"}]}]], greedy)
    turn = [{"role": "user", "content": [{"type": "video", "video": str(video)}, {"type": "text", "text": "What happens?"}]}]
    row: dict[str, Any] = {"mode": mode}
    answer = ""
    for name, messages in (("first", turn), ("second", None)):
        if messages is None:  # the next turn: the answer so far, a new question, the same video again
            messages = [*turn, {"role": "assistant", "content": answer}, *turn]
        _sync(cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        steps_before = len(engine.runner.counters.encoded_per_step)
        encoded_before = engine.runner.counters.images_encoded
        t0 = time.perf_counter()
        rid = engine.add_request(messages, greedy)
        pre = time.perf_counter() - t0
        prompt_tokens = engine.peek(rid).prompt_tokens  # type: ignore[union-attr]
        while not ((out := engine.peek(rid)) is not None and out.token_ids):
            done = engine.step()
            if done:
                out = done[0]
                break
        _sync(cuda)
        ttft = time.perf_counter() - t0
        answer = engine.processor.decode(out.token_ids) if out is not None else ""
        while engine.has_unfinished():
            engine.step()
        per_step = engine.runner.counters.encoded_per_step[steps_before:]
        row[name] = {
            "prompt_tokens": prompt_tokens, "pre_s": pre, "gpu_s": ttft - pre, "ttft_s": ttft,
            "peak_gib": _peak(cuda) / 2**30,
            "peak_over_idle_gib": (_peak(cuda) - base) / 2**30,
            "vit_groups": engine.runner.counters.images_encoded - encoded_before,
            "encoded_first_step": next((n for n in per_step if n), 0),
        }
    del engine
    gc.collect()  # the engine holds reference cycles: without a collection its GPU memory outlives it
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", default="7b", help="7b (Qwen2.5-VL-7B), qwen3-8b, ... (benchmarks/checkpoints.py)")
    ap.add_argument("--durations", default="30,120,300", help="seconds of 720p video")
    ap.add_argument("--source-fps", type=int, default=30)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--kv-cache-mb", type=int, default=20000)
    ap.add_argument("--mm-cache-mb", type=float, default=2048)
    ap.add_argument("--max-model-len", type=int, default=128000)
    ap.add_argument("--decode-only", action="store_true", help="only the CPU decode rows")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (with --shape demo)")
    ap.add_argument("--decode-seconds", type=float, default=30.0)
    ap.add_argument("--checkpoints", type=Path, default=None,
                    help="folder of SHAPE/ checkpoint dirs written beforehand (benchmarks.checkpoints)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        results["decode"] = decode_rows(tmp, args.source_fps, args.decode_seconds)
        print(f"{'size':>6} {'all frames/s':>13} {'sampled frames/s':>17} {'video s per s':>14}")
        for r in results["decode"]:
            print(f"{r['size']:>6} {r['all_frames_per_s']:13.0f} {r['sampled_frames_per_s']:17.1f} {r['video_s_per_s']:14.1f}")
        if not args.decode_only:
            results["device"] = torch.cuda.get_device_name() if args.device == "cuda" else args.device
            model_dir = checkpoint(tmp, args.shape, args.checkpoints)
            results["requests"] = []
            print(f"\n{results['device']}, {args.shape}, chunk {args.chunk_size}")
            print(f"{'video':>6} {'mode':>8} {'turn':>6} {'tokens':>7} {'pre s':>7} {'gpu s':>7} {'TTFT s':>7} "
                  f"{'peak GiB':>9} {'+idle':>7} {'ViT groups':>10} {'1st step':>8}")
            for seconds in (float(s) for s in args.durations.split(",")):
                video = make_video(tmp / f"video-{seconds:g}s.mp4", seconds, "720p", args.source_fps)
                for mode in ("image", "request"):
                    row = {"seconds": seconds, **engine_row(model_dir, video, mode, args)}
                    results["requests"].append(row)
                    for turn in ("first", "second"):
                        r = row[turn]
                        print(f"{seconds:6g} {mode:>8} {turn:>6} {r['prompt_tokens']:7d} {r['pre_s']:7.2f} "
                              f"{r['gpu_s']:7.2f} {r['ttft_s']:7.2f} {r['peak_gib']:9.2f} "
                              f"{r['peak_over_idle_gib']:7.2f} {r['vit_groups']:10d} {r['encoded_first_step']:8d}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
