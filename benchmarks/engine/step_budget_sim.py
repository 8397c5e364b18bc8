"""The steps the scheduler plans for the harness's (b) on a dense model under each step budget, without a model: how
many steps, the largest step's prompt and ViT tokens, and, through a linear cost model of a step, the load's length
and its inter-token gaps.

(b) sends ``--requests`` chat requests at once, each a 1080p image (2,040 tokens of Qwen3-VL's tower) between a few
text tokens, and 128 greedy tokens each; every image is written before the first plan. ``SchedulerCore`` plans with
`glimpse serve`'s CUDA defaults (128-token blocks, the decode-step image cap 2,048) for each ``--variants`` entry
``CHUNK:COST`` (``--chunk-size`` and ``--encode-token-cost``). A step is modelled as ``--step-ms`` plus
``--prefill-us`` per prompt token plus ``--vit-us`` per image token it encodes. The defaults fit the Qwen3-VL-8B
shape's (b) on an H200 (2026-12-02, every token timed): 7.99 req/s in 196 steps at the defaults (model: 7.66 in 191)
and 6.32 in 323 at 2048:1 before a prompt's tail could ride with the next image's encode (model, that rule: 6.32 in
317). The plan counts are exact; the times rank variants before a GPU run, they do not replace it.

    python -m benchmarks.engine.step_budget_sim
    python -m benchmarks.engine.step_budget_sim --variants 4096:0,2048:0.75,2048:1 --requests 128
"""

from __future__ import annotations

from benchmarks.args import parser
from benchmarks.engine.step_mix_sim import GRID, IMAGE_TOKENS, TEXT_BEFORE
from ipc.prompts import MMItem, SamplingParams
from ipc.steps import StepResult
from workers.engine.core.scheduler import SchedulerCore

TEXT_AFTER, OUTPUT = 30, 128  # (b)'s prompt text after the image in a Qwen3-VL chat, and its output tokens


def simulate(requests: int, chunk: int, cost: float, step_ms: float, prefill_us: float, vit_us: float) -> dict[str, float]:
    core = SchedulerCore(
        num_blocks=12288, block_size=128, chunk_size=chunk, max_num_seqs=128, max_model_len=32768,
        mm_cache_bytes=8 << 30, embedding_bytes_per_token=8192, eos_token_ids=(0,), lone_prefill_tokens=chunk,
        decode_step_image_tokens=2048, encode_token_cost=cost,
    )  # fmt: skip
    prompt_len = TEXT_BEFORE + IMAGE_TOKENS + TEXT_AFTER
    for r in range(requests):
        image = MMItem(r.to_bytes(16, "big"), TEXT_BEFORE, IMAGE_TOKENS, GRID)
        core.add(f"r{r}", [1 + r] * prompt_len, 0, [image], SamplingParams(max_tokens=OUTPUT, ignore_eos=True))
    now = 0.0
    steps = prefill_steps = 0
    last: dict[str, float] = {}
    gaps: list[float] = []
    while core.has_work() and (plan := core.schedule()) is not None:
        prompt = sum(ch.length for ch in plan.chunks if ch.start < prompt_len)
        vit = sum(it.length for job in plan.encode for it in job.items)
        took = step_ms + (prompt * prefill_us + vit * vit_us) / 1000
        now += took
        steps, prefill_steps = steps + 1, prefill_steps + bool(prompt)
        sampled = [ch.rid for ch in plan.chunks if ch.sample]
        for rid in sampled:
            if rid in last:
                gaps.append(now - last[rid])
            last[rid] = now
        core.update(StepResult(plan.step_id, [(rid, 5) for rid in sampled]))
    gaps.sort()
    return {"steps": steps, "prefill": prefill_steps, "seconds": now / 1000, "p90": gaps[int(0.9 * len(gaps))],
            "p99": gaps[int(0.99 * len(gaps))], "max": gaps[-1]}  # fmt: skip


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--variants", default="4096:0,2048:0,2048:0.5,2048:0.75,2048:1",
                    help="CHUNK:COST entries (--chunk-size, --encode-token-cost), comma-separated")
    ap.add_argument("--step-ms", type=float, default=14.0, help="a step's fixed cost (decode rows included)")
    ap.add_argument("--prefill-us", type=float, default=25.0, help="per prompt token a step computes")
    ap.add_argument("--vit-us", type=float, default=18.0, help="per image token a step encodes")
    args = ap.parse_args()
    print(f"(b) on the scheduler: {args.requests} requests of {TEXT_BEFORE + IMAGE_TOKENS + TEXT_AFTER} prompt tokens "
          f"(one 1080p image), {OUTPUT} output tokens each; times from the model ({args.step_ms} ms + "
          f"{args.prefill_us} us a prompt token + {args.vit_us} us an image token)")
    print("\n| chunk | encode cost | steps | prefill steps | modelled s | req/s | inter-token p90 / p99 / max, ms "
          "|\n|---|---|---|---|---|---|---|")
    for entry in args.variants.split(","):
        chunk, cost = entry.split(":")
        r = simulate(args.requests, int(chunk), float(cost), args.step_ms, args.prefill_us, args.vit_us)
        print(f"| {chunk} | {cost} | {r['steps']:.0f} | {r['prefill']:.0f} | {r['seconds']:.2f} "
              f"| {args.requests / r['seconds']:.2f} | {r['p90']:.0f} / {r['p99']:.0f} / {r['max']:.0f} |")


if __name__ == "__main__":
    main()
