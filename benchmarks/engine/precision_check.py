"""How far the bf16 engine's logits are from float32 on the same weights, per GPU code path.

Swapping one kernel for another (a GEMM layout, an attention kernel) moves the bf16 logits of a deep
random-weight model by a few percent. This puts that next to the bf16 error itself: a float32 engine
holding the same bf16-rounded weights is the reference, and each bf16 path is compared with it, so
"within bf16 tolerance" becomes a number.

    python -m benchmarks.engine.precision_check
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.args import parser
from benchmarks.checkpoints import shaped_checkpoint
from benchmarks.engine.engine_bench import RESOLUTIONS, messages_with, noise_image
from benchmarks.engine.engine_step_bench import Spy, rel
from ipc.prompts import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.kernels import fused
from workers.engine.offline import Engine

Rows = list[list[torch.Tensor]]  # per request (in order), the logits row that produced each token


def run(
    engine: Engine, spy: Spy, requests: list[list[dict[str, Any]]], tokens: int
) -> tuple[Rows, list[list[int]]]:
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(messages, greedy) for messages in requests]
    spy.steps, spy.recording = [], True
    done: dict[str, list[int]] = {}
    while len(done) < len(rids):
        done.update((out.rid, list(out.token_ids)) for out in engine.step())
    spy.recording = False
    return [[step[rid] for step in spy.steps if rid in step] for rid in rids], [done[r] for r in rids]


def compare(name: str, a: tuple[Rows, list[list[int]]], b: tuple[Rows, list[list[int]]], k: int) -> None:
    """Rows that produced token k of each request, where both runs fed the same tokens before it."""
    pairs = [
        (ra[k], rb[k]) for ra, rb, ta, tb in zip(a[0], b[0], a[1], b[1], strict=True) if ta[:k] == tb[:k]
    ]
    x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    agree = int((x.argmax(-1) == y.argmax(-1)).sum())
    print(f"  {name:50} rel L2 {rel(x, y):.2e}  argmax equal {agree}/{len(pairs)}")


def check(model_dir: Path, args: argparse.Namespace) -> None:
    def build(dtype: Any, fused_kernels: bool, attn_backend: Any = "auto") -> Engine:
        # No embedding or prefix cache: every run recomputes everything.
        return Engine(
            EngineConfig(
                model=str(model_dir),
                device=args.device,
                dtype=dtype,
                mm_cache_mb=0.001,
                load_format="dummy" if args.shape != "demo" else "auto",
                kv_cache_mb=2048,
                max_model_len=65536,
                enable_prefix_caching=False,
                fused_kernels=fused_kernels,
                attn_backend=attn_backend,
            )
        )

    e16, e32 = build("bfloat16", True, args.attn_backend), build("float32", False)  # the reference runs plain eager ops
    with torch.no_grad():  # the reference holds exactly the bf16 weights, in float32
        for src, dst in ((e16.runner.lm, e32.runner.lm), (e16.runner.vision, e32.runner.vision)):
            for p16, p32 in zip(src.parameters(), dst.parameters(), strict=True):
                p32.copy_(p16.float())
    s16, s32 = Spy(e16.runner), Spy(e32.runner)
    e32.runner.graphs = None
    w, h = RESOLUTIONS["1080p"]
    image = [messages_with([noise_image(w, h, seed=300)], "Describe the picture.")]
    texts = [[{"role": "user", "content": f"Story {i}: " + "word " * 40}] for i in range(args.batch)]
    ref_img, ref_txt = run(e32, s32, image, 1), run(e32, s32, texts, 3)
    fused_img, graph = run(e16, s16, image, 1), run(e16, s16, texts, 3)
    for module in (e16.runner.lm, e16.runner.vision):
        fused.enable(module, False)
    e16.runner.graphs = None  # captured graphs hold the fused kernels: the eager-ops decode runs without them
    eager_img, eager = run(e16, s16, image, 1), run(e16, s16, texts, 3)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"\nbf16 ({e16.runner.lm.attention_backend(e16.runner.device).name}) vs float32 on the same weights ({card}): logits of 1 x 1080p + text (first token) and of a "
        f"{args.batch}-request text batch (first decode step)"
    )
    compare("image, fused kernels vs fp32", fused_img, ref_img, 0)
    compare("image, eager ops vs fp32", eager_img, ref_img, 0)
    compare("image, fused vs eager ops", fused_img, eager_img, 0)
    compare("decode, CUDA graph + fused kernels vs fp32", graph, ref_txt, 1)
    compare("decode, eager flash varlen + eager ops vs fp32", eager, ref_txt, 1)
    compare("decode, graph + fused vs eager", graph, eager, 1)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=["demo", "7b"], default="7b")
    ap.add_argument("--attn-backend", default="auto", choices=["auto", "flash", "fa3"],
                    help="the bf16 engine's attention (the float32 reference runs its default)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        check(shaped_checkpoint(Path(tmp) / "ckpt", args.shape), args)


if __name__ == "__main__":
    main()
