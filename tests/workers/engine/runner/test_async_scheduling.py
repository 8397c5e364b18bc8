"""Asynchronous scheduling: a step planned while the step before it runs (SchedulerCore.schedule(ahead=True)), the
model runner taking the ids of tokens still being sampled from its own samples, and the offline Engine's greedy tokens
with it on equal to those with it off (CPU, float32, demo checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ipc.prompts import SamplingParams, StructuredSpec
from ipc.steps import StepPlan, StepResult
from tests.workers.engine.core.test_scheduler import EOS, add, core
from tests.workers.engine.hf_reference import chat
from tests.workers.engine.test_offline import noise_image
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine


def first_step(c: Any) -> StepPlan:
    plan = c.schedule()
    assert plan is not None and not plan.ahead
    return plan


def planned_ahead(c: Any) -> tuple[StepPlan, StepPlan]:
    """The first step, and the step planned ahead while it runs."""
    prefill = first_step(c)
    ahead = c.schedule(ahead=True)
    assert ahead is not None
    return prefill, ahead


def sampled(plan: StepPlan, tokens: dict[str, int]) -> StepResult:
    return StepResult(plan.step_id, [(ch.rid, tokens[ch.rid]) for ch in plan.chunks if ch.sample])


def test_a_decode_step_is_planned_while_the_prefill_runs() -> None:
    c = core(block_size=4)
    add(c, "a", 7, max_tokens=8)
    add(c, "b", 4, max_tokens=8)
    prefill, ahead = planned_ahead(c)
    assert ahead.ahead
    # Each sequence decodes the token the prefill is sampling: one past what the worker was sent, no ids to send.
    assert [(ch.rid, ch.start, ch.length, ch.new_token_ids, ch.sample) for ch in ahead.chunks] == [
        ("a", 7, 1, [], True),
        ("b", 4, 1, [], True),
    ]
    assert [ch.new_blocks for ch in ahead.chunks] == [[], []]  # admission reserved the first decode's blocks
    assert c.schedule(ahead=True) is None  # one step ahead at most
    c.update(sampled(prefill, {"a": 10, "b": 20}))
    nxt = c.schedule(ahead=True)
    assert nxt is not None
    # The prefill's samples are known now and go out with the next step; its own ids come from the step ahead.
    assert [(ch.start, ch.new_token_ids) for ch in nxt.chunks] == [(8, [10]), (5, [20])]
    # "a"'s position 8 starts its third block (block size 4); "b"'s position 5 is in its second.
    assert [len(ch.new_blocks) for ch in nxt.chunks] == [1, 0] and len(c.seqs["a"].block_table) == 3
    with pytest.raises(RuntimeError):
        c.update(sampled(nxt, {"a": 1, "b": 2}))  # results come back in order
    updates = c.update(sampled(ahead, {"a": 11, "b": 21}))
    assert [(u.rid, u.token_id) for u in updates] == [("a", 11), ("b", 21)]
    assert c.seqs["a"].output_ids == [10, 11] and c.seqs["a"].num_computed == 8


def test_prefill_chunks_and_new_requests_are_planned_ahead_too() -> None:
    c = core(chunk_size=16)
    add(c, "long", 40)
    first = first_step(c)
    add(c, "late", 5)  # arrives while the first chunk runs

    def rows(plan: StepPlan | None) -> list[tuple[str, int, int, bool]]:
        assert plan is not None and plan.ahead
        return [(ch.rid, ch.start, ch.length, ch.sample) for ch in plan.chunks]

    second = c.schedule(ahead=True)
    assert rows(second) == [("long", 16, 16, False)]  # starts where the chunk in flight ends
    c.update(sampled(first, {}))
    third = c.schedule(ahead=True)
    assert rows(third) == [("long", 32, 8, True), ("late", 0, 5, True)]  # the newcomer takes the rest of the budget
    c.update(sampled(second, {}))
    fourth = c.schedule(ahead=True)
    # Both decode the tokens the third step is sampling.
    assert rows(fourth) == [("long", 40, 1, True), ("late", 5, 1, True)]
    assert fourth is not None and [ch.new_token_ids for ch in fourth.chunks] == [[], []]
    c.update(sampled(third, {"long": 9, "late": 7}))
    c.update(sampled(fourth, {"long": 10, "late": 8}))
    assert c.seqs["late"].output_ids == [7, 8] and c.seqs["long"].output_ids == [9, 10]
    assert (c.seqs["long"].num_computed, c.seqs["long"].num_scheduled, c.seqs["long"].in_flight) == (41, 41, 0)


def test_a_grammar_waits_for_its_token() -> None:
    g = core()
    g.add("s", [1] * 6, 0, [], SamplingParams(max_tokens=8, structured=StructuredSpec("json_object")))
    add(g, "plain", 6, max_tokens=8)
    prefill, ahead = planned_ahead(g)
    assert [ch.rid for ch in ahead.chunks] == ["plain"]  # its next mask needs the token
    g.update(sampled(prefill, {"s": 3, "plain": 4}))
    nxt = g.schedule(ahead=True)
    assert nxt is not None and [(ch.rid, ch.start, ch.new_token_ids) for ch in nxt.chunks] == [("s", 6, [3]), ("plain", 7, [4])]


def test_a_sequence_whose_token_in_flight_is_its_last_is_left_out() -> None:
    c = core()
    add(c, "one", 5, max_tokens=1)
    add(c, "two", 5, max_tokens=2)
    prefill, ahead = planned_ahead(c)
    assert [ch.rid for ch in ahead.chunks] == ["two"]
    updates = c.update(sampled(prefill, {"one": 7, "two": 7}))
    assert [(u.rid, u.finish_reason) for u in updates] == [("one", "length"), ("two", None)]
    assert c.schedule(ahead=True) is None  # "two"'s token in flight is its last; "one" alone is not worth a step
    updates = c.update(sampled(ahead, {"two": 8}))
    assert [(u.rid, u.token_id, u.finish_reason) for u in updates] == [("two", 8, "length")]
    assert c.allocator.num_used == 0
    last = c.schedule()  # nothing to compute, but the workers must still drop both
    assert last is not None and not last.chunks and last.finished == ["one", "two"]


def test_eos_on_the_token_in_flight_drops_the_sample_planned_ahead() -> None:
    c = core()
    add(c, "a", 5, max_tokens=8)
    add(c, "b", 5, max_tokens=8)
    prefill, ahead = planned_ahead(c)
    updates = c.update(sampled(prefill, {"a": EOS, "b": 4}))
    assert [(u.rid, u.finish_reason) for u in updates] == [("a", "stop"), ("b", None)]
    nxt = c.schedule(ahead=True)
    assert nxt is not None and [ch.rid for ch in nxt.chunks] == ["b"] and nxt.finished == ["a"]
    updates = c.update(sampled(ahead, {"a": 42, "b": 5}))  # "a"'s second token was computed for nothing
    assert [(u.rid, u.token_id) for u in updates] == [("b", 5)]
    assert c.samples_dropped == 1 and "a" not in c.seqs


def test_short_of_blocks_it_waits_instead_of_preempting() -> None:
    c = core(num_blocks=2, block_size=4)
    add(c, "a", 7, max_tokens=8)  # both blocks: positions 0-7
    prefill, ahead = planned_ahead(c)
    assert c.allocator.num_free == 0  # position 7 fits the blocks it holds
    c.update(sampled(prefill, {"a": 1}))
    assert c.schedule(ahead=True) is None  # position 8 needs a third block: wait for the result, do not preempt
    assert c.preemptions == 0 and c.seqs["a"] in c.running
    c.update(sampled(ahead, {"a": 2}))
    assert c.seqs["a"].output_ids == [1, 2]


def make_engine(model_dir: Path, async_scheduling: bool, chunk_size: int = 4096) -> Engine:
    config = EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256, block_size=16, chunk_size=chunk_size,
        lone_prefill_tokens=0,
    )  # fmt: skip
    return Engine(config, async_scheduling=async_scheduling)


@pytest.mark.parametrize("chunk_size", [4096, 24])
def test_engine_tokens_are_the_same_with_steps_planned_ahead(demo_model_dir: Path, chunk_size: int) -> None:
    requests = [
        chat("Describe the picture.", [noise_image(64, 48, 1)]),
        chat("Two pictures: which is brighter?", [noise_image(40, 40, 2), noise_image(96, 32, 3)]),
        [{"role": "user", "content": "Count to ten."}],
        [{"role": "user", "content": "Say something short."}],
        [{"role": "user", "content": "Two answers, please."}],
    ]
    params = [
        SamplingParams(max_tokens=9, temperature=0.0),
        SamplingParams(max_tokens=14, temperature=0.0),
        SamplingParams(max_tokens=3, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=5, temperature=0.0, n=2),  # its second choice forks off in a step
    ]
    reference = make_engine(demo_model_dir, False, chunk_size).generate(requests, params)
    engine = make_engine(demo_model_dir, True, chunk_size)
    planned: list[StepPlan] = []
    launch = engine.runner.launch
    engine.runner.launch = lambda plan: planned.append(plan) or launch(plan)  # type: ignore[method-assign,func-returns-value]
    outputs = engine.generate(requests, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert [o.finish_reason for o in outputs] == [r.finish_reason for r in reference]
    assert [len(o.token_ids) for o in outputs] == [9, 14, 3, 1, 5, 5]
    ahead = [p for p in planned if p.ahead]
    # Every step but the first was planned while the one before it ran: 13 more tokens for the longest request.
    assert len(ahead) >= 13
    if chunk_size == 24:  # prompt chunks, new requests and images went out ahead too, beside decodes of others
        assert any(p.encode for p in ahead) and any(ch.length > 1 for p in ahead for ch in p.chunks)


def test_a_step_ahead_after_a_failed_step_reads_no_stale_ids_and_spares_the_others(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir, async_scheduling=True)
    engine.add_request([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=6, temperature=0.0), rid="a")
    plan = engine.core.schedule()
    assert plan is not None
    first = engine.runner.launch(plan).result()
    engine.add_request([{"role": "user", "content": "another"}], SamplingParams(max_tokens=6, temperature=0.0), rid="b")
    ahead = engine.core.schedule(ahead=True)
    assert ahead is not None and [ch.rid for ch in ahead.chunks] == ["a", "b"]
    # Had the step before failed, the worker holds no samples: "a"'s row (failed with that step by the scheduler)
    # computes a placeholder instead of an id from an older step, and "b", admitted ahead, still gets its token.
    engine.runner.last_sampled = None
    result = engine.runner.launch(ahead).result()
    assert [rid for rid, _ in result.sampled] == ["a", "b"]
    [expected] = make_engine(demo_model_dir, async_scheduling=False).generate(
        [[{"role": "user", "content": "another"}]], SamplingParams(max_tokens=1, temperature=0.0)
    )
    assert dict(result.sampled)["b"] == expected.token_ids[0]
    engine.core.update(first)
    engine.core.update(result)
    mid = engine.core.schedule()
    assert mid is not None
    engine.runner.launch(mid)
    nxt = engine.core.schedule(ahead=True)
    assert nxt is not None and [ch.rid for ch in nxt.chunks] == ["a", "b"]  # both decode tokens being sampled
    engine.runner.last_sampled = (torch.zeros(1, dtype=torch.int64), {"someone-else": 0})
    with pytest.raises(RuntimeError, match="did not sample"):  # a real mismatch still fails loudly
        engine.runner.launch(nxt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs, pinned copies and events: GPU only")
def test_on_the_gpu_steps_planned_ahead_give_the_same_tokens(demo_model_dir: Path) -> None:
    def engine(async_scheduling: bool) -> Engine:
        config = EngineConfig(model=str(demo_model_dir), device="cuda", dtype="float32", num_kv_blocks=256, chunk_size=24)
        return Engine(config, async_scheduling=async_scheduling)

    requests = [
        chat("Describe the picture.", [noise_image(64, 48, 1)]),
        [{"role": "user", "content": "Count to ten."}],
        [{"role": "user", "content": "Two answers, please."}],
    ]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 2 + [
        SamplingParams(max_tokens=12, temperature=0.0, n=2, ignore_eos=True)
    ]
    reference = engine(False).generate(requests, params)
    ahead = engine(True)
    outputs = ahead.generate(requests, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    graphs = ahead.runner.graphs
    assert graphs is not None and graphs.stats["replays"] > 0  # decode steps planned ahead replayed graphs
