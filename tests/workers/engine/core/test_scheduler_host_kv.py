"""The scheduling core with the prefix cache's host tier: what admission loads, what plans carry, what a failed step
undoes, and what the KV-event hooks see."""

from __future__ import annotations

from ipc.prompts import SamplingParams
from ipc.steps import StepPlan, StepResult
from workers.engine.core.kv_cache import block_hashes
from workers.engine.core.scheduler import SchedulerCore, Sequence

A = list(range(1, 17))  # 4 full blocks of 4 tokens
B = [50 + i for i in range(20)]  # 5 full blocks: with its output, it takes all 6 blocks


def core(num_blocks: int = 6, kv_host_slots: int = 8) -> SchedulerCore:
    return SchedulerCore(
        num_blocks=num_blocks, block_size=4, chunk_size=64, max_num_seqs=8, max_model_len=512, mm_cache_bytes=0,
        embedding_bytes_per_token=10, eos_token_ids=(99,), kv_host_slots=kv_host_slots,
    )  # fmt: skip


def finish(c: SchedulerCore, rid: str, tokens: list[int]) -> list[StepPlan]:
    """Run request ``rid`` (one output token) to its end; the plans that computed it."""
    c.add(rid, tokens, 0, [], SamplingParams(max_tokens=1, temperature=0))
    plans = []
    while c.has_work():
        plan = c.schedule()
        assert plan is not None
        c.update(StepResult(plan.step_id, [(ch.rid, 5) for ch in plan.chunks if ch.sample]))
        plans += [plan] if plan.chunks else []  # (the last one only tells the workers it finished)
    return plans


def a_then_b(c: SchedulerCore) -> list[StepPlan]:
    """A runs and leaves its 4 blocks in the prefix cache; B's allocation recycles them all."""
    assert [(p.kv_spill, p.kv_load) for p in finish(c, "a", A)] == [([], [])]
    return finish(c, "b", B)


def test_recycled_blocks_spill_in_the_plan_that_reuses_them() -> None:
    c = core()
    [plan] = a_then_b(c)
    # Free order after A: 5, then A's 4..0 (a table is freed tail first); B takes all six, and A's registered 3..0
    # go to host slots 0..3 in that order.
    assert plan.kv_spill == [(3, 0), (2, 1), (1, 2), (0, 3)] and plan.kv_load == []
    assert plan.chunks[0].new_blocks == [5, 4, 3, 2, 1, 0]
    assert c.allocator.host is not None and c.allocator.host.match(block_hashes(A, 4)) == [3, 2, 1, 0]


def test_admission_continues_with_the_host_tier_and_counts_it_cached() -> None:
    c = core()
    a_then_b(c)
    c.add("a2", [*A, 7, 8, 9], 0, [], SamplingParams(max_tokens=1, temperature=0))
    plan = c.schedule()
    assert plan is not None
    # Free order after B (tail first): its partial block 0, then its full blocks 1..5. A's 4 blocks load from
    # slots 3..0 into the first four handed out, the rest of the prompt takes block 4; B's blocks among them spill
    # to the free slots first.
    assert plan.kv_spill == [(1, 4), (2, 5), (3, 6), (4, 7)]
    assert plan.kv_load == [(3, 0), (2, 1), (1, 2), (0, 3)]
    [chunk] = plan.chunks
    assert (chunk.start, chunk.length, chunk.new_blocks[:4]) == (16, 3, [0, 1, 2, 3])
    seq = c.seqs["a2"]
    assert seq.cached_tokens == 16 and seq.registered == 4
    assert c.allocator.match(block_hashes(A, 4)) == [0, 1, 2, 3]  # on the device again, for any later request
    assert c.allocator.prefix_hit_tokens == 0 and c.allocator.host is not None
    assert c.allocator.host.hit_tokens == 16 and c.allocator.host.loads == 4


def test_spills_never_take_a_slot_the_step_loads_from() -> None:
    c = core(kv_host_slots=4)
    a_then_b(c)  # A's 4 keys fill the 4 slots
    c.add("a2", [*A, 7, 8, 9], 0, [], SamplingParams(max_tokens=1, temperature=0))
    plan = c.schedule()
    assert plan is not None
    # Every slot is read by this step's loads: B's recycled blocks are dropped, not spilled over them.
    assert plan.kv_spill == [] and len(plan.kv_load) == 4
    assert c.allocator.host is not None and c.allocator.host.match(block_hashes(A, 4)) == [3, 2, 1, 0]


def test_loaded_blocks_are_published_as_stored() -> None:
    c = core()
    stored: list[tuple[str, list[int]]] = []
    removed: list[bytes] = []

    def on_stored(seq: Sequence, indices: list[int], keys: list[bytes]) -> None:
        stored.append((seq.rid, indices))

    c.on_blocks_stored, c.allocator.on_evict = on_stored, removed.append
    a_then_b(c)
    assert removed == block_hashes(A, 4)[::-1]  # recycled on the device, tail first (spilled to the host): removals, as before
    stored.clear()
    c.add("a2", [*A, 7, 8, 9], 0, [], SamplingParams(max_tokens=1, temperature=0))
    c.schedule()
    assert stored == [("a2", [0, 1, 2, 3])]  # on the device again, at admission (the loads precede any read)


def test_a_failed_step_forgets_its_host_copies() -> None:
    c = core()
    a_then_b(c)
    c.add("a2", [*A, 7, 8, 9], 0, [], SamplingParams(max_tokens=1, temperature=0))
    plan = c.schedule()
    assert plan is not None and plan.kv_load
    assert c.fail_step(plan.step_id) == ["a2"]
    host, keys_a, keys_b = c.allocator.host, block_hashes(A, 4), block_hashes(B, 4)
    assert host is not None
    # The loads may not have run: their blocks lose A's keys. The spills may not have either: B's keys leave the
    # host. A's keys stay there (a load only reads its slot).
    assert c.allocator.match(keys_a) == [] and host.match(keys_b) == [] and host.match(keys_a) == [3, 2, 1, 0]
    assert host.num_used == 4
    # A later prompt with A's prefix loads it again.
    c.add("a3", [*A, 7], 0, [], SamplingParams(max_tokens=1, temperature=0))
    plan = c.schedule()
    assert plan is not None and [slot for slot, _ in plan.kv_load] == [3, 2, 1, 0]
