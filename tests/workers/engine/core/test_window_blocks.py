"""The sliding-window layers' own block pool in the scheduling core (Gemma 4): a sequence holds only its window's
blocks plus a chunk's, released blocks go to other sequences, prefix hits need the window resident, and no block a
step reads is handed to another sequence in that same step."""

from __future__ import annotations

from ipc.prompts import SamplingParams
from ipc.steps import StepPlan, StepResult
from workers.engine.core.kv_cache import block_hashes
from workers.engine.core.scheduler import SchedulerCore
from workers.engine.core.window_blocks import SENTINEL

BS, WINDOW, CHUNK = 4, 8, 8
PER_SEQ = -(-(WINDOW + CHUNK) // BS) + 1  # window_blocks.py's bound: 5


def core(window_blocks: int = 64, **overrides: object) -> SchedulerCore:
    args: dict[str, object] = dict(
        num_blocks=256, block_size=BS, chunk_size=CHUNK, max_num_seqs=8, max_model_len=512,
        mm_cache_bytes=10_000, embedding_bytes_per_token=10, eos_token_ids=(99,),
        window=WINDOW, window_blocks=window_blocks,
    )
    args.update(overrides)
    return SchedulerCore(**args)  # type: ignore[arg-type]


def add(c: SchedulerCore, rid: str, tokens: list[int], max_tokens: int = 4, n: int = 1) -> None:
    c.add(rid, tokens, 0, [], SamplingParams(max_tokens=max_tokens, temperature=0, n=n))


class Worker:
    """The window tables as a worker keeps them from the plans, and the check that every step finds the window
    blocks its queries read, none of them written by another sequence in the same step."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def check(self, plan: StepPlan) -> None:
        for rid in plan.finished:
            self.tables.pop(rid, None)
        for f in plan.forks:
            self.tables[f.child] = list(f.window_table)
        owner: dict[int, str] = {}
        for chunk in plan.chunks:
            table = self.tables.setdefault(chunk.rid, [])
            table.extend(chunk.new_window_blocks)
            end = chunk.start + chunk.length
            needed = table[max(0, chunk.start - WINDOW + 1) // BS : -(-end // BS)]
            assert len(table) >= -(-end // BS) and SENTINEL not in needed, (chunk, table)
            for block in needed:
                assert owner.setdefault(block, chunk.rid) == chunk.rid, (block, chunk.rid, owner[block])


def result(plan: StepPlan, token: int = 5) -> StepResult:
    """Every sampled row's token: the chunks' and, for choices forked this step, theirs (from the parent's logits)."""
    return StepResult(plan.step_id, [(ch.rid, token) for ch in plan.chunks if ch.sample] + [(f.child, token) for f in plan.forks])


def run(c: SchedulerCore, worker: Worker, token: int = 5) -> StepPlan:
    plan = c.schedule()
    assert plan is not None
    worker.check(plan)
    c.update(result(plan, token))
    return plan


def held(c: SchedulerCore, rid: str) -> int:
    return sum(1 for b in c.seqs[rid].window_table if b != SENTINEL)


def test_a_long_sequence_keeps_only_its_window_while_its_global_blocks_grow() -> None:
    c, worker = core(), Worker()
    add(c, "a", list(range(1, 61)), max_tokens=30)
    most = 0
    while "a" in c.seqs:
        run(c, worker)
        if "a" in c.seqs:
            most = max(most, held(c, "a"))
            assert held(c, "a") <= PER_SEQ
            assert len(c.seqs["a"].block_table) * BS >= c.seqs["a"].num_computed
    assert 3 <= most <= PER_SEQ
    assert c.windows is not None and c.windows.released > 10
    assert c.windows.allocator.num_used == 0 and c.allocator.num_used == 0


def test_released_window_blocks_serve_other_sequences() -> None:
    """A pool of twice one sequence's bound runs three long sequences at once (their global blocks would need 3 x 23)."""
    c, worker = core(window_blocks=2 * PER_SEQ), Worker()
    for i in range(3):
        add(c, f"r{i}", [10 * i + 1 + (j % 7) for j in range(80)], max_tokens=10)
    used: dict[str, set[int]] = {}
    while c.has_work():
        plan = run(c, worker)
        for ch in plan.chunks:
            used.setdefault(ch.rid, set()).update(b for b in ch.new_window_blocks if b >= 0)
    assert c.windows is not None and c.windows.allocator.num_used == 0
    assert len(set().union(*used.values())) <= 2 * PER_SEQ
    assert used["r0"] & used["r1"] or used["r0"] & used["r2"]  # one's released blocks went to another


def test_a_prefix_hit_needs_its_window_resident_and_shrinks_when_it_was_recycled() -> None:
    c, worker = core(window_blocks=3 * PER_SEQ, enable_prefix_caching=True), Worker()
    prompt = [(7 * j) % 50 + 1 for j in range(41)]
    add(c, "a", prompt, max_tokens=1)
    while c.has_work():
        run(c, worker)
    # The same prompt again: its blocks are all cached (a's window blocks released late are still registered).
    add(c, "b", prompt, max_tokens=1)
    plan = run(c, worker)
    depth = c.seqs["b"].num_computed // BS if "b" in c.seqs else None
    assert plan.chunks[0].start == 40  # every block but the last token's: its window was resident
    assert plan.chunks[0].new_window_blocks[:8] == [SENTINEL] * 8  # (40 - 8 + 1) // 4 = 8 leading sentinels
    while c.has_work():
        run(c, worker)
    # Other prompts recycle the oldest freed window blocks (the prompt's last ones were freed last).
    for i in range(3):
        add(c, f"x{i}", [100 + i + j % 5 for j in range(24)], max_tokens=1)
    while c.has_work():
        run(c, worker)
    assert c.windows is not None
    hashes = block_hashes(prompt, BS, 40 // BS)
    resident = [c.windows.allocator.is_cached(h) for h in hashes]
    # The deepest depth whose window blocks are all resident (the global pool still holds every block).
    expected = max((d for d in range(1, 11) if all(resident[max(0, d * BS - WINDOW + 1) // BS : d])), default=0)
    assert all(c.allocator.is_cached(h) for h in hashes) and expected < 10
    add(c, "c", prompt, max_tokens=1)
    plan = run(c, worker)
    assert plan.chunks[0].start == expected * BS, (resident, depth)
    while c.has_work():
        run(c, worker)
    assert c.windows.allocator.num_used == 0


def test_choices_share_and_copy_the_window_blocks() -> None:
    c, worker = core(), Worker()
    add(c, "a", list(range(1, 31)), max_tokens=6, n=3)  # 30 tokens: a partial last block, copied per choice
    forks = []
    while c.has_work():
        plan = c.schedule()
        assert plan is not None
        forks.extend(plan.forks)
        for f in plan.forks:
            worker.tables[f.child] = list(f.window_table)
        for chunk in plan.chunks:
            worker.tables.setdefault(chunk.rid, []).extend(chunk.new_window_blocks)
        c.update(result(plan))
    assert len(forks) == 2
    for f in forks:
        assert f.window_copy is not None and f.window_table[-1] == f.window_copy[1]
        # The prompt's last chunk started at 24: the blocks before its window went back before the fork.
        assert f.window_table[:4] == [SENTINEL] * 4 and SENTINEL not in f.window_table[4:]
    assert c.windows is not None and c.windows.allocator.num_used == 0 and c.allocator.num_used == 0


def test_planning_ahead_keeps_the_window_blocks_a_step_reads() -> None:
    c, worker = core(window_blocks=2 * PER_SEQ), Worker()
    for i in range(3):
        add(c, f"r{i}", [20 * i + 1 + (j % 9) for j in range(50)], max_tokens=12)
    in_flight: list[StepPlan] = []
    while c.has_work() or in_flight:
        plan = c.schedule(ahead=True) if in_flight else c.schedule()
        if plan is not None:
            worker.check(plan)
            in_flight.append(plan)
        if plan is None or len(in_flight) == 2:
            done = in_flight.pop(0)
            c.update(result(done))
    assert c.windows is not None and c.windows.allocator.num_used == 0


def test_families_without_windows_plan_as_before() -> None:
    c = core(window=0, window_blocks=0)
    add(c, "a", list(range(1, 21)))
    plan = c.schedule()
    assert plan is not None and c.windows is None
    assert all(ch.new_window_blocks == [] for ch in plan.chunks)
    assert b"new_window_blocks" not in __import__("msgspec").msgpack.encode(plan)
