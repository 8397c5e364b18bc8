"""The scheduler's CPU time from a multiturn chat's arrival to its first plan, per KV block size.

Each round of the chat resends the whole history (every earlier 1080p image: 2,691 tokens each in Qwen2.5-VL-7B)
and adds one image, as the multiturn bench does; earlier rounds' blocks are in the prefix cache. Per round this
times `SchedulerCore.add`, `schedule` (prefix keys, matching, the plan) with the plan's msgpack encode, and the
model worker's decode of it: the work between a request's arrival at the scheduler and its first step that grows
with the prompt. Block sizes are interleaved; the table shows medians over the passes.

    python -m benchmarks.engine.sched_plan_bench --rounds 8 --block-sizes 16,128 --passes 5
"""

from __future__ import annotations

import random
import statistics
import time

import msgspec

from benchmarks.args import parser
from ipc.prompts import MMItem, SamplingParams
from ipc.steps import StepPlan, StepResult
from workers.engine.core.scheduler import SchedulerCore

IMAGE_TOKENS, GRID = 2691, (1, 78, 138)  # one 1080p image, merged 2 x 2
PAD = 151655


def one_chat(block_size: int, rounds: int, seed: int) -> list[tuple[int, float, float, float, int]]:
    """(prompt tokens, add ms, schedule + encode ms, decode ms, plan bytes) for each round's first plan."""
    core = SchedulerCore(
        num_blocks=196_608 // block_size, block_size=block_size, chunk_size=4096, max_num_seqs=128,
        max_model_len=32768, mm_cache_bytes=8 << 30, embedding_bytes_per_token=7168, eos_token_ids=(2,),
        enable_prefix_caching=True, lone_prefill_tokens=4096,
    )  # fmt: skip
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StepPlan)
    rng = random.Random(seed)
    ids: list[int] = []
    items: list[MMItem] = []
    rows = []
    for r in range(rounds):
        ids += [rng.randrange(3, 150_000) for _ in range(40)]
        items.append(MMItem(rng.randbytes(16), len(ids), IMAGE_TOKENS, GRID))
        ids += [PAD] * IMAGE_TOKENS + [rng.randrange(3, 150_000) for _ in range(60)]
        t0 = time.perf_counter()
        core.add(f"r{r}", list(ids), 0, list(items), SamplingParams(max_tokens=16, temperature=0))
        t1 = time.perf_counter()
        plan = core.schedule()
        assert plan is not None
        data = encoder.encode(plan)
        t2 = time.perf_counter()
        decoder.decode(data)
        t3 = time.perf_counter()
        rows.append((len(ids), 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2), len(data)))
        while plan is not None:  # the rest of the prefill, then one token that ends it (2 is EOS here)
            core.update(StepResult(plan.step_id, [(c.rid, 2) for c in plan.chunks if c.sample]))
            plan = core.schedule()
        ids += [rng.randrange(3, 150_000) for _ in range(20)]  # the answer, in the next round's history
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()
    sizes = [int(b) for b in args.block_sizes.split(",")]
    runs: dict[int, list[list[tuple[int, float, float, float, int]]]] = {b: [] for b in sizes}
    for p in range(args.passes):
        for b in sizes:
            runs[b].append(one_chat(b, args.rounds, p))
    print(f"ms per round's first plan, median of {args.passes} chats")
    print("| round | prompt tokens | block | add | schedule + encode | worker decode | plan KB |")
    print("|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        for b in sizes:
            cells = [statistics.median(run[r][i] for run in runs[b]) for i in (1, 2, 3)]
            tokens, size = runs[b][0][r][0], runs[b][0][r][4]
            print(f"| {r + 1} | {tokens} | {b} | {cells[0]:.2f} | {cells[1]:.2f} | {cells[2]:.2f} | {size / 1024:.0f} |")


if __name__ == "__main__":
    main()
