"""A hybrid model's state pool on the scheduling side: live slots, snapshots at block boundaries under prefix keys,
restores on a prefix hit, and what happens to them on eviction, preemption, forks and failed steps."""

from __future__ import annotations

import pytest

from ipc.prompts import MMItem, SamplingParams
from ipc.steps import StepPlan, StepResult
from workers.engine.core.scheduler import SchedulerCore
from workers.engine.core.state_cache import OutOfStateSlots, StatePool, snapshot_points

EOS = 99
BS = 4


def core(**overrides: object) -> SchedulerCore:
    args: dict[str, object] = dict(
        num_blocks=64, block_size=BS, chunk_size=16, max_num_seqs=8, max_model_len=512,
        mm_cache_bytes=10_000, embedding_bytes_per_token=10, eos_token_ids=(EOS,),
        enable_prefix_caching=True, state_slots=8, state_snapshot_every=0,
    )
    args.update(overrides)
    return SchedulerCore(**args)  # type: ignore[arg-type]


def add(c: SchedulerCore, rid: str, ids: list[int], max_tokens: int = 2, n: int = 1, items: list[MMItem] | None = None) -> None:
    c.add(rid, ids, 0, items or [], SamplingParams(max_tokens=max_tokens, temperature=0, n=n))


def step(c: SchedulerCore, token: int = 5) -> StepPlan:
    plan = c.schedule()
    assert plan is not None
    sampled = [ch.rid for ch in plan.chunks if ch.sample] + [f.child for f in plan.forks]  # a choice: parent's logits
    c.update(StepResult(plan.step_id, [(rid, token) for rid in sampled]))
    return plan


def finish_all(c: SchedulerCore) -> list[StepPlan]:
    plans = []
    while c.has_work():
        plans.append(step(c))
    return plans


def test_pool_hands_out_live_slots_and_evicts_the_oldest_snapshot_for_them() -> None:
    pool = StatePool(3)
    a, b = pool.allocate(2)
    snap = pool.reserve(b"k1")
    assert snap is not None and snap not in (a, b) and pool.reserve(b"k2") is None  # every slot live or pending
    assert not pool.wanted(b"k1")
    pool.publish(snap)
    assert pool.lookup(b"k1") == snap and pool.available == 1
    assert pool.allocate(1) == [snap]  # the snapshot goes for a live state
    assert pool.lookup(b"k1") is None and pool.snapshots_evicted == 1
    with pytest.raises(OutOfStateSlots):
        pool.allocate(1)
    pool.release([a])
    with pytest.raises(ValueError):
        pool.release([a])


def test_pool_publishes_a_prefix_once_and_drops_it_with_its_block() -> None:
    pool = StatePool(4)
    first, second = pool.reserve(b"k"), pool.reserve(b"k")  # two sequences computing the same prefix at once
    assert first is not None and second is not None
    pool.publish(first)
    pool.publish(second)  # a duplicate: its slot is freed
    assert pool.num_snapshots == 1 and pool.available == 4
    pool.drop(b"k")
    assert pool.num_snapshots == 0 and pool.lookup(b"k") is None


def test_snapshot_points() -> None:
    # The last block boundary before the prompt's final token, and every `every` blocks.
    assert snapshot_points(0, 16, 16, 4, 0) == [12]
    assert snapshot_points(0, 16, 17, 4, 0) == [16]
    assert snapshot_points(0, 8, 17, 4, 0) == []  # the last boundary lies in a later chunk
    assert snapshot_points(0, 40, 40, 4, 2) == [8, 16, 24, 32, 36]
    assert snapshot_points(8, 24, 40, 4, 2) == [16, 24]  # (start, end]
    assert snapshot_points(0, 3, 3, 4, 1) == []  # no full block before the final token


def test_a_prompt_snapshots_its_last_block_and_a_repeat_resumes_from_it() -> None:
    c = core()
    prompt = list(range(1, 15))  # 14 tokens: boundary 12
    add(c, "a", prompt)
    first = c.schedule()
    assert first is not None
    assert first.new_seqs[0].state_slot >= 0
    [(rid, position, slot)] = first.snapshots
    assert (rid, position) == ("a", 12) and slot != first.new_seqs[0].state_slot
    c.update(StepResult(first.step_id, [("a", 5)]))
    assert c.state is not None and c.state.num_snapshots == 1
    finish_all(c)
    assert c.state.live == 0 and c.state.num_snapshots == 1
    add(c, "b", prompt)
    plan = step(c)
    assert plan.state_copies == [(slot, plan.new_seqs[0].state_slot)]
    assert [(ch.start, ch.length) for ch in plan.chunks] == [(12, 2)]
    assert c.state.restores == 1 and c.state.restored_tokens == 12


def test_a_longer_turn_resumes_from_the_deepest_snapshot_within_its_cached_blocks() -> None:
    c = core(state_snapshot_every=1, chunk_size=64)
    add(c, "a", list(range(1, 22)))  # snapshots at 4, 8, 12, 16, 20
    finish_all(c)
    add(c, "b", list(range(1, 19)) + [77, 78, 79, 80, 81])  # shares 18 tokens: blocks up to 16
    plan = step(c)
    assert [(ch.start, ch.length) for ch in plan.chunks] == [(16, 7)]
    assert len(plan.state_copies) == 1


def test_kv_blocks_without_a_snapshot_give_a_hybrid_model_no_hit() -> None:
    c = core()
    prompt = list(range(1, 15))
    add(c, "a", prompt)
    finish_all(c)
    assert c.state is not None
    c.state.drop(next(iter(c.state._snapshots)))  # the KV blocks stay cached, the state is gone
    add(c, "b", prompt)
    plan = step(c)
    assert plan.state_copies == [] and plan.chunks[0].start == 0


def test_evicted_blocks_take_their_snapshots_along() -> None:
    c = core(num_blocks=8)
    add(c, "a", list(range(1, 15)))
    finish_all(c)
    assert c.state is not None and c.state.num_snapshots == 1
    add(c, "b", list(range(100, 128)))  # needs every block: a's cached ones are recycled
    step(c)
    assert c.state.num_snapshots == 0


def test_live_slots_bound_admission() -> None:
    c = core(state_slots=1)
    add(c, "a", [1, 2, 3], max_tokens=3)
    add(c, "b", [4, 5, 6], max_tokens=3)
    plan = step(c)
    assert [ch.rid for ch in plan.chunks] == ["a"]  # b waits for a's slot
    plans = finish_all(c)
    assert any(ch.rid == "b" for p in plans for ch in p.chunks)
    assert c.state is not None and c.state.live == 0


def test_choices_get_slots_copied_from_their_parent_after_the_prompt() -> None:
    c = core(state_slots=4)
    add(c, "a", list(range(1, 10)), n=3)
    plan = step(c)
    parent = plan.new_seqs[0].state_slot
    slots = {f.state_slot for f in plan.forks}
    assert len(plan.forks) == 2 and len(slots) == 2 and parent not in slots and -1 not in slots
    assert c.state is not None and c.state.live == 3
    finish_all(c)
    assert c.state.live == 0


def test_preemption_frees_the_slot_and_a_failed_step_its_snapshots() -> None:
    c = core()
    add(c, "a", list(range(1, 15)))
    plan = c.schedule()
    assert plan is not None and plan.snapshots
    assert c.state is not None and c.state.live == 1
    c.fail_step(plan.step_id)
    assert c.state.live == 0 and c.state.num_snapshots == 0 and c.state.available == 8


def chunk_ends(c: SchedulerCore) -> list[tuple[str, int, int]]:
    """(rid, start, end) of every chunk of every step until the core is idle."""
    return [(ch.rid, ch.start, ch.start + ch.length) for plan in finish_all(c) for ch in plan.chunks]


def test_a_hybrid_models_prefill_chunks_end_on_the_kernels_chunk_grid() -> None:
    # Two prompts of 400 tokens sharing 300-token steps: every chunk inside a prompt ends at a multiple of 64, so the
    # next starts there and the snapshots every 4 blocks (64 tokens) fall on fla's chunk starts. The first step's
    # 44 leftover tokens do not start "b" off the grid: it waits for the next step.
    c = core(chunk_size=300, block_size=16, state_snapshot_every=4, num_blocks=128)
    add(c, "a", list(range(1, 401)), max_tokens=1)
    add(c, "b", list(range(401, 801)), max_tokens=1)
    first = c.schedule()
    assert first is not None and [s.rid for s in c.running] == ["a"]  # 44 tokens left fund no chunk: "b" waits
    c.update(StepResult(first.step_id, []))
    assert [(ch.rid, ch.start, ch.length) for ch in first.chunks] + [
        (rid, s, e - s) for rid, s, e in chunk_ends(c)
    ] == [("a", 0, 256), ("a", 256, 144), ("b", 0, 128), ("b", 128, 272)]


def test_steps_smaller_than_four_grid_cells_keep_their_whole_budget() -> None:
    # 100-token steps cut back to the grid would carry 64 tokens each: below 256 the grid is off.
    c = core(chunk_size=100, num_blocks=128)
    add(c, "a", list(range(1, 251)), max_tokens=1)
    assert [(s, e) for _, s, e in chunk_ends(c)] == [(0, 100), (100, 200), (200, 250)]


def test_chunks_without_a_state_pool_use_the_whole_budget() -> None:
    c = core(chunk_size=200, state_slots=0, num_blocks=128)
    add(c, "a", list(range(1, 301)), max_tokens=1)
    assert [(s, e) for _, s, e in chunk_ends(c)] == [(0, 200), (200, 300)]


def test_text_before_an_image_the_cap_holds_back_waits_on_the_grid() -> None:
    # "d" decodes, so each step may encode 100 image tokens: "a"'s image takes them, and "b"'s chunk would stop
    # before its own image after 8 tokens of text, leaving "b" off the 64-token grid for its next chunk (its
    # snapshot at 192 would then cut that chunk's kernel call). It waits a step and then goes whole.
    c = core(chunk_size=300, block_size=16, state_snapshot_every=4, num_blocks=256, decode_step_image_tokens=100,
             mm_cache_bytes=1_000_000)  # fmt: skip
    add(c, "d", list(range(1, 41)), max_tokens=50)
    step(c)
    image = [MMItem(bytes([tag]) * 16, 8, 100, (1, 20, 20)) for tag in (1, 2)]
    add(c, "a", list(range(41, 241)), max_tokens=1, items=[image[0]])
    add(c, "b", list(range(241, 441)), max_tokens=1, items=[image[1]])
    first, second = step(c), step(c)
    assert [(ch.rid, ch.start, ch.length) for ch in first.chunks] == [("d", 40, 1), ("a", 0, 200)]
    assert [(ch.rid, ch.start, ch.length) for ch in second.chunks if ch.rid == "b"] == [("b", 0, 200)]


def test_a_chunk_cut_by_its_own_image_against_the_cap_is_taken_off_the_grid() -> None:
    # "a"'s first image fits the 100-token cap, its second does not: waiting would cut it the same way every step
    # while "d" decodes, so the 20-token piece goes (off the grid) and the second image goes alone next.
    c = core(chunk_size=300, block_size=16, state_snapshot_every=4, num_blocks=256, decode_step_image_tokens=100,
             mm_cache_bytes=1_000_000)  # fmt: skip
    add(c, "d", list(range(1, 41)), max_tokens=50)
    step(c)
    images = [MMItem(bytes([1]) * 16, 2, 10, (1, 2, 20)), MMItem(bytes([2]) * 16, 20, 100, (1, 20, 20))]
    add(c, "a", list(range(41, 241)), max_tokens=1, items=images)
    chunks = [(ch.start, ch.length) for _ in range(3) for ch in step(c).chunks if ch.rid == "a"]
    assert chunks == [(0, 20), (20, 180)]
