"""``encode_token_cost`` under random loads: every request finishes (no sequence waits forever for a step the rule
never gives it), and a step with decodes spends at most its budget on prefill tokens and encodes, but for one image
that goes alone (beside a prompt's tail at most). On plain, whole-image (Gemma 4's bidirectional spans) and hybrid (64-token chunk grid) cores."""

from __future__ import annotations

import math
import random

import pytest

from ipc.prompts import MMItem, SamplingParams
from ipc.steps import EncodeJob, StepPlan, StepResult
from workers.engine.core.chunking import SMALL_PREFILL_SHARE
from workers.engine.core.scheduler import SchedulerCore

EOS = 99


def _core(kind: str, cost: float, cap: int) -> SchedulerCore:
    extra: dict[str, object] = {}
    if kind == "whole":
        extra["whole_images"] = True
    elif kind == "hybrid":
        extra.update(state_slots=16, state_snapshot_every=4)
    return SchedulerCore(
        num_blocks=4096, block_size=16, chunk_size=256, max_num_seqs=8, max_model_len=4096,
        mm_cache_bytes=10_000_000, embedding_bytes_per_token=10, eos_token_ids=(EOS,),
        decode_step_image_tokens=cap, encode_token_cost=cost, enable_prefix_caching=False, **extra,  # type: ignore[arg-type]
    )


def _prompt(rng: random.Random, tag: int) -> tuple[int, list[MMItem]]:
    """A prompt of text and 0-3 images (8-300 tokens each, some larger than a step's budget), with up to 200 tokens of
    text after each, so that prefills span steps and meet other sequences' images."""
    items: list[MMItem] = []
    pos = rng.randint(0, 20)
    for _ in range(rng.randint(0, 3)):
        length = rng.choice([8, 40, 120, 300])
        items.append(MMItem(tag.to_bytes(2, "big") + bytes([len(items)]) * 14, pos, length, (1, 2, 2 * length)))
        pos += length + rng.randint(0, 200)
    return pos + rng.randint(1, 200), items


def _owner(job: EncodeJob) -> str:
    """The request an encode job's image belongs to: every image key here starts with its request's tag."""
    return f"r{int.from_bytes(job.key[:2], 'big')}"


def _check_budget(c: SchedulerCore, plan: StepPlan, prompt_lens: dict[str, int], cost: float) -> None:
    prefill = [ch for ch in plan.chunks if ch.start < prompt_lens[ch.rid]]
    decodes = len(plan.chunks) - len(prefill)
    if not decodes or not prefill:
        return
    jobs = plan.encode[: len(plan.encode) - plan.encode_ahead]
    price = sum(math.ceil(cost * it.length) for job in jobs for it in job.items[:1])
    if len(jobs) == 1:
        # One image alone may cost more than the budget (its chunk then reaches into it), beside other prefill chunks
        # of at most SMALL_PREFILL_SHARE of the budget in all (a prompt's tail).
        if sum(ch.length for ch in prefill if ch.rid != _owner(jobs[0])) <= c.chunk_size // SMALL_PREFILL_SHARE:
            return
    assert decodes + sum(ch.length for ch in prefill) + price <= c.chunk_size, plan


@pytest.mark.parametrize("kind", ["plain", "whole", "hybrid"])
@pytest.mark.parametrize(("cost", "cap"), [(0.5, 0), (1.0, 0), (3.0, 0), (1.0, 128)])
def test_every_request_finishes_and_steps_keep_their_budget(kind: str, cost: float, cap: int) -> None:
    rng = random.Random(f"{kind}-{cost}-{cap}")
    c = _core(kind, cost, cap)
    prompt_lens: dict[str, int] = {}
    outputs: dict[str, int] = {}
    for step in range(3000):
        if step % 2 == 0 and len(prompt_lens) < 32:  # arrivals while others decode
            rid = f"r{len(prompt_lens)}"
            n, items = _prompt(rng, len(prompt_lens))
            prompt_lens[rid] = n
            c.add(rid, [1] * n, 0, items, SamplingParams(max_tokens=6, temperature=0))
        if not c.has_work():
            if len(prompt_lens) == 32:
                break
            continue
        plan = c.schedule()
        assert plan is not None, f"step {step}: work left but nothing planned"
        if kind == "plain":  # (whole images and the hybrid grid may round a chunk past the budget by design)
            _check_budget(c, plan, prompt_lens, cost)
        sampled = [(ch.rid, 5) for ch in plan.chunks if ch.sample]
        for rid, _ in sampled:
            outputs[rid] = outputs.get(rid, 0) + 1
        c.update(StepResult(plan.step_id, sampled))
    assert not c.has_work() and len(prompt_lens) == 32
    assert outputs == {rid: 6 for rid in prompt_lens}


def test_a_prompts_tail_rides_with_the_next_image() -> None:
    """(b)'s shape: requests of one image that costs more than the budget, all sent at once. Each prompt's tail
    (the tokens a budget-sized chunk leaves) goes in the step of the next request's encode instead of a step of its
    own: two prefill steps a request, where the image had to wait for a step without any other prefill before."""
    c = SchedulerCore(
        num_blocks=4096, block_size=16, chunk_size=1024, max_num_seqs=16, max_model_len=4096,
        mm_cache_bytes=100_000_000, embedding_bytes_per_token=10, eos_token_ids=(EOS,),
        decode_step_image_tokens=2048, encode_token_cost=1.0, enable_prefix_caching=False,
    )
    # 4 text tokens, a 1,030-token image (costs more than the 1,024 budget), 8 text tokens: with the decode rows a
    # budget-sized chunk leaves a tail of 14-30 tokens, under the budget's 64-token share.
    for i in range(16):
        items = [MMItem(i.to_bytes(2, "big") + b"i" * 14, 4, 1030, (1, 2, 2060))]
        c.add(f"r{i}", [1] * 1042, 0, items, SamplingParams(max_tokens=60, temperature=0))
    prefill_steps = tails_with_images = 0
    while c.has_work():
        plan = c.schedule()
        assert plan is not None
        prefill = [ch for ch in plan.chunks if ch.start < 1042]
        prefill_steps += bool(prefill)
        if plan.encode and len(prefill) > 1:
            tails_with_images += 1
            assert sum(ch.length for ch in prefill if ch.rid != _owner(plan.encode[0])) <= 1024 // SMALL_PREFILL_SHARE
        c.update(StepResult(plan.step_id, [(ch.rid, 5) for ch in plan.chunks if ch.sample]))
    assert tails_with_images == 15  # every request's encode but the first carried the one before's tail
    # Two a request, its encode (with the tail before) and its chunk; the first two requests' encodes went in steps
    # without decodes (no encode cost), and the last tail alone. The rule before gave the tails a step each (~3 a request).
    assert prefill_steps == 2 * 16 - 1
