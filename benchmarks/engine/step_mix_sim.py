"""The steps the scheduler plans for the harness's (b) on a hybrid model, without a model: how many prefill steps,
how many prompt tokens each carries, and how many of them hold a state snapshot off the gated delta kernels'
64-token chunk grid (each such step runs a layer's chunked kernels once per cut instead of once).

(b) sends ``--requests`` chat requests at once, each a 1080p image (2,040 tokens of Qwen3.5's tower) between a few
text tokens, and 128 greedy tokens each; every image is written before the first plan. ``SchedulerCore`` plans
with `glimpse serve`'s CUDA defaults (4,096-token steps, 128-token blocks, a snapshot every 16 blocks) for each
``--caps`` value of ``--decode-step-image-tokens``, with the chunk grid on and off. Pure bookkeeping: CPU only, no
timing (a step's GPU time is decode_profile's and the harness's).

    python -m benchmarks.engine.step_mix_sim
    python -m benchmarks.engine.step_mix_sim --requests 128 --caps 0,2048,4096
"""

from __future__ import annotations

from benchmarks.args import parser
from ipc.prompts import MMItem, SamplingParams
from ipc.steps import StepPlan, StepResult
from workers.engine.core.scheduler import SchedulerCore
from workers.engine.core.state_cache import CHUNK_ALIGN

IMAGE_TOKENS, GRID = 2040, (1, 68, 120)  # 1920 x 1088 in 16-pixel patches, merged 2 x 2
TEXT_BEFORE, TEXT_AFTER = 15, 100


def off_grid(plan: StepPlan) -> bool:
    """Whether a snapshot of the step falls inside a chunk at an offset the kernels' chunks do not start at."""
    chunks = {ch.rid: ch for ch in plan.chunks}
    return any(0 < point - chunks[rid].start < chunks[rid].length and (point - chunks[rid].start) % CHUNK_ALIGN
               for rid, point, _ in plan.snapshots)  # fmt: skip


def simulate(requests: int, cap: int, grid: bool) -> tuple[int, int, int, float, int]:
    """(steps, prefill steps, those with decodes too, prompt tokens per prefill step, off-grid steps)."""
    core = SchedulerCore(
        num_blocks=12288, block_size=128, chunk_size=4096, max_num_seqs=128, max_model_len=32768,
        mm_cache_bytes=8 << 30, embedding_bytes_per_token=10240, eos_token_ids=(0,), lone_prefill_tokens=4096,
        decode_step_image_tokens=cap, state_slots=256, state_snapshot_every=16,
    )  # fmt: skip
    if not grid:
        core.chunk_align = 1
    prompt_len = TEXT_BEFORE + IMAGE_TOKENS + TEXT_AFTER
    for r in range(requests):
        image = MMItem(r.to_bytes(16, "big"), TEXT_BEFORE, IMAGE_TOKENS, GRID)
        core.add(f"r{r}", [1 + r] * prompt_len, 0, [image], SamplingParams(max_tokens=128, ignore_eos=True))
    steps = mixed = tokens = prefill_steps = off = 0
    while core.has_work() and (plan := core.schedule()) is not None:
        steps += 1
        prompt = sum(ch.length for ch in plan.chunks if ch.start < prompt_len)
        if prompt:
            prefill_steps += 1
            tokens += prompt
            mixed += any(ch.start >= prompt_len for ch in plan.chunks)
        off += off_grid(plan)
        core.update(StepResult(plan.step_id, [(ch.rid, 5) for ch in plan.chunks if ch.sample]))
    return steps, prefill_steps, mixed, tokens / max(1, prefill_steps), off


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--caps", default="2048,0", help="--decode-step-image-tokens values, comma-separated")
    args = ap.parse_args()
    print(f"(b) on the scheduler: {args.requests} requests of {TEXT_BEFORE + IMAGE_TOKENS + TEXT_AFTER} prompt "
          "tokens (one 1080p image), 128 output tokens each")
    print("\n| image cap | chunk grid | steps | prefill steps (with decodes) | prompt tokens a prefill step "
          "| steps with a snapshot off the grid |\n|---|---|---|---|---|---|")
    for cap in (int(c) for c in args.caps.split(",")):
        for grid in (False, True):
            steps, prefill, mixed, per_step, off = simulate(args.requests, cap, grid)
            print(f"| {cap} | {'on' if grid else 'off'} | {steps} | {prefill} ({mixed}) | {per_step:,.0f} | {off} |")


if __name__ == "__main__":
    main()
