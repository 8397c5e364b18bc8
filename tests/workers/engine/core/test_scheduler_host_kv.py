"""The scheduling core with the prefix cache's host tier: what admission loads, what plans carry, what a failed step
undoes, and what the KV-event hooks see."""

from __future__ import annotations

from ipc.prompts import SamplingParams
from ipc.steps import StepPlan, StepResult
from workers.engine.core.kv_cache import block_hashes
from workers.engine.core.scheduler import SchedulerCore, Sequence

A = list(range(1, 17))  # 4 full blocks of 4 tokens
B = [50 + i for i in range(16)]


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
    # Free order after A: 5, then A's 0..4; B takes 5 and A's registered 0..3, which go to host slots 0..3 first.
    assert plan.kv_spill == [(0, 0), (1, 1), (2, 2), (3, 3)] and plan.kv_load == []
    assert plan.chunks[0].new_blocks == [5, 0, 1, 2, 3]
    assert c.allocator.host is not None and c.allocator.host.match(block_hashes(A, 4)) == [0, 1, 2, 3]


def test_admission_continues_with_the_host_tier_and_counts_it_cached() -> None:
    c = core()
    a_then_b(c)
    c.add("a2", [*A, 7, 8, 9], 0, [], SamplingParams(max_tokens=1, temperature=0))
    plan = c.schedule()
    assert plan is not None
    # Free order after B: 4, then B's 5, 0, 1, 2 (its full blocks), 3. A's 4 blocks load from slots 0..3 into the
    # first four handed out, the rest of the prompt takes block 2; B's blocks among them spill to free slots first.
    assert plan.kv_spill == [(5, 4), (0, 5), (1, 6), (2, 7)]
    assert plan.kv_load == [(0, 4), (1, 5), (2, 0), (3, 1)]
    [chunk] = plan.chunks
    assert (chunk.start, chunk.length, chunk.new_blocks[:4]) == (16, 3, [4, 5, 0, 1])
    seq = c.seqs["a2"]
    assert seq.cached_tokens == 16 and seq.registered == 4
    assert c.allocator.match(block_hashes(A, 4)) == [4, 5, 0, 1]  # on the device again, for any later request
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
    assert c.allocator.host is not None and c.allocator.host.match(block_hashes(A, 4)) == [0, 1, 2, 3]


def test_loaded_blocks_are_published_as_stored() -> None:
    c = core()
    stored: list[tuple[str, list[int]]] = []
    removed: list[bytes] = []

    def on_stored(seq: Sequence, indices: list[int], keys: list[bytes]) -> None:
        stored.append((seq.rid, indices))

    c.on_blocks_stored, c.allocator.on_evict = on_stored, removed.append
    a_then_b(c)
    assert removed == block_hashes(A, 4)  # recycled on the device (spilled to the host): removals, as before
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
    assert c.allocator.match(keys_a) == [] and host.match(keys_b) == [] and host.match(keys_a) == [0, 1, 2, 3]
    assert host.num_used == 4
    # A later prompt with A's prefix loads it again.
    c.add("a3", [*A, 7], 0, [], SamplingParams(max_tokens=1, temperature=0))
    plan = c.schedule()
    assert plan is not None and [slot for slot, _ in plan.kv_load] == [0, 1, 2, 3]
