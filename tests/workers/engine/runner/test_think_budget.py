"""thinking_token_budget in the sampler (workers/engine/runner/think_budget.py): the end marker is forced on the draw
after the budget's last thinking token, counted from the start marker (or from the first token when the prompt
opened the reasoning), never again once the reasoning ended; forks, removals and a re-add after preemption keep
each request's own count."""

from __future__ import annotations

import torch

from ipc.prompts import SamplingParams
from workers.engine.runner.sampler import Sampler
from workers.engine.runner.think_budget import BEFORE, DONE, INSIDE, replay

VOCAB, START, END, WORD = 12, 10, 11, 3


def params(budget: int, inside: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0, think_budget=budget, think_ids=(START, END), think_inside=inside)


def favour(*tokens: int) -> torch.Tensor:
    """Logits whose argmax is each row's token."""
    logits = torch.zeros(len(tokens), VOCAB)
    for row, token in enumerate(tokens):
        logits[row, token] = 5.0
    return logits


def run(sampler: Sampler, rids: list[str], ps: list[SamplingParams], wanted: list[list[int]]) -> list[list[int]]:
    """Each step the model 'wants' wanted[step][row]; returns what each row drew."""
    drawn: list[list[int]] = [[] for _ in rids]
    for step in wanted:
        for row, token in enumerate(sampler.sample(favour(*step), rids, ps).tokens):
            drawn[row].append(token)
    return drawn


def test_the_end_marker_is_forced_at_the_budget() -> None:
    sampler = Sampler(torch.device("cpu"), vocab_size=VOCAB)
    opened, closes, plain = params(2), params(5), SamplingParams(temperature=0)
    for rid, p in (("a", opened), ("b", closes), ("c", plain), ("d", params(0, inside=True))):
        sampler.add(rid, p)
    wanted = [[START, START, WORD, WORD], [WORD, WORD, WORD, WORD], [WORD, END, WORD, WORD],
              [WORD, WORD, WORD, WORD], [WORD, WORD, WORD, WORD]]
    a, b, c, d = run(sampler, ["a", "b", "c", "d"], [opened, closes, plain, params(0, inside=True)], wanted)
    assert a == [START, WORD, WORD, END, WORD]  # two thinking tokens after <think>, then </think> forced
    assert b == [START, WORD, END, WORD, WORD]  # closed by the model within its budget: nothing forced after
    assert c == [WORD, WORD, WORD, WORD, WORD]  # no budget: untouched
    assert d == [END, WORD, WORD, WORD, WORD]  # budget 0 inside an opened reasoning: </think> at once


def test_forks_removals_and_a_re_add_keep_their_own_count() -> None:
    sampler = Sampler(torch.device("cpu"), vocab_size=VOCAB)
    p = params(3, inside=True)
    sampler.add("a", p)
    assert run(sampler, ["a"], [p], [[WORD]]) == [[WORD]]
    sampler.fork("a", "a.1", p)  # a choice forked after one thinking token: two left each
    assert run(sampler, ["a", "a.1"], [p, p], [[WORD, WORD], [WORD, WORD], [WORD, WORD]]) == [
        [WORD, WORD, END], [WORD, WORD, END]]
    sampler.remove("a")
    # Preempted and re-added with its output so far: the count is rebuilt from it.
    sampler.add("b", p, output_ids=[WORD, WORD])
    assert run(sampler, ["b", "a.1"], [p, p], [[WORD, WORD], [WORD, WORD]]) == [[WORD, END], [WORD, WORD]]
    assert replay(p, [WORD, WORD]) == (INSIDE, 1)
    assert replay(params(3), [WORD, START, WORD, END]) == (DONE, 2)
    assert replay(params(3), [WORD]) == (BEFORE, 3)


def test_slots_grow_past_the_first_capacity() -> None:
    sampler = Sampler(torch.device("cpu"), vocab_size=VOCAB)
    rids = [f"r{i}" for i in range(70)]
    ps = [params(1, inside=True)] * len(rids)
    for rid in rids:
        sampler.add(rid, ps[0])
    drawn = run(sampler, rids, ps, [[WORD] * len(rids)] * 3)
    assert all(d == [WORD, END, WORD] for d in drawn)
