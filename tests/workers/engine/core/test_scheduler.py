"""The scheduling core on its own: admission, chunking, preemption and the embedding plan."""

from __future__ import annotations

import pytest

from ipc.prompts import MMItem, SamplingParams
from ipc.steps import StepPlan, StepResult
from workers.engine.core.scheduler import RequestRejected, SchedulerCore

EOS = 99


def core(**overrides: object) -> SchedulerCore:
    args: dict[str, object] = dict(
        num_blocks=64, block_size=4, chunk_size=16, max_num_seqs=8, max_model_len=512,
        mm_cache_bytes=10_000, embedding_bytes_per_token=10, eos_token_ids=(EOS,),
        enable_prefix_caching=False,  # on in the prefix-caching tests below
    )
    args.update(overrides)
    return SchedulerCore(**args)  # type: ignore[arg-type]


def add(c: SchedulerCore, rid: str, n: int, items: list[MMItem] | None = None, max_tokens: int = 4) -> None:
    c.add(rid, [1] * n, 0, items or [], SamplingParams(max_tokens=max_tokens, temperature=0))


def run_step(c: SchedulerCore, token: int = 5) -> StepPlan:
    plan = c.schedule()
    assert plan is not None
    c.update(StepResult(plan.step_id, [(ch.rid, token) for ch in plan.chunks if ch.sample]))
    return plan


def item(tag: int, offset: int, length: int) -> MMItem:
    return MMItem(bytes([tag]) * 16, offset, length, (1, 2, 2 * length))


def test_prefill_is_chunked_under_the_token_budget() -> None:
    c = core(chunk_size=16)
    add(c, "a", 40)
    lengths = [run_step(c).chunks[0].length for _ in range(3)]
    assert lengths == [16, 16, 8]
    plan = run_step(c)  # first decode
    assert [(ch.start, ch.length, ch.new_token_ids) for ch in plan.chunks] == [(40, 1, [5])]


def test_decodes_go_first_and_share_the_budget_with_prefill() -> None:
    c = core(chunk_size=16)
    add(c, "a", 8)
    run_step(c)
    add(c, "b", 30)
    plan = run_step(c)
    assert [(ch.rid, ch.length) for ch in plan.chunks] == [("a", 1), ("b", 15)]


def test_lone_prefill_takes_the_larger_budget_until_someone_decodes() -> None:
    c = core(chunk_size=16, lone_prefill_tokens=48)
    add(c, "a", 60, max_tokens=8)
    add(c, "b", 100, max_tokens=8)
    # Nobody decodes yet: 48 tokens per step, shared in arrival order.
    assert [(ch.rid, ch.length) for ch in run_step(c).chunks] == [("a", 48)]
    assert [(ch.rid, ch.length) for ch in run_step(c).chunks] == [("a", 12), ("b", 36)]
    # a decodes now, so the step is back to chunk_size: a's token first, then 15 of b's prompt.
    assert [(ch.rid, ch.length) for ch in run_step(c).chunks] == [("a", 1), ("b", 15)]
    assert core(chunk_size=16, lone_prefill_tokens=0).lone_prefill_tokens == 16  # 0: off


def test_request_that_can_never_fit_is_rejected() -> None:
    c = core(num_blocks=4, block_size=4, max_model_len=1000)
    with pytest.raises(RequestRejected, match="KV blocks"):
        add(c, "big", 16)  # 16 tokens + 1 need 5 blocks of 4
    with pytest.raises(RequestRejected, match="context length"):
        add(core(max_model_len=10), "long", 10)


def test_request_that_cannot_fit_now_waits_then_runs() -> None:
    c = core(num_blocks=6, block_size=4, chunk_size=64)
    add(c, "a", 15, max_tokens=2)  # 4 blocks
    add(c, "b", 15, max_tokens=2)  # has to wait for a's blocks
    plan = run_step(c)
    assert [ch.rid for ch in plan.chunks] == ["a"] and len(c.waiting) == 1
    run_step(c)  # a finishes (max_tokens=2) and frees its blocks
    assert "a" not in c.seqs
    plan = run_step(c)
    assert [ch.rid for ch in plan.chunks] == ["b"] and plan.finished == ["a"]


def test_preemption_recomputes_and_frees_blocks() -> None:
    c = core(num_blocks=5, block_size=4, chunk_size=64)
    add(c, "a", 7, max_tokens=20)  # 2 blocks
    add(c, "b", 7, max_tokens=20)  # 2 blocks
    run_step(c)
    for _ in range(2):
        run_step(c)  # both reach 9 tokens: need a third block each, only one is free
    assert c.preemptions >= 1
    victim = c.waiting[0]
    assert victim.rid == "b" and victim.block_table == [] and victim.num_computed == 0
    assert c.allocator.num_used + c.allocator.num_free == 5


def test_only_images_overlapping_the_chunk_are_planned() -> None:
    c = core(chunk_size=16)
    add(c, "a", 48, items=[item(1, 4, 8), item(2, 20, 8), item(3, 36, 8)])
    keys = [[job.key[0] for job in run_step(c).encode] for _ in range(3)]
    assert keys == [[1], [2], [3]]


def test_image_split_across_chunks_is_encoded_once() -> None:
    c = core(chunk_size=8)
    add(c, "a", 24, items=[item(1, 4, 12)])
    plans = [run_step(c) for _ in range(3)]
    assert [len(p.encode) for p in plans] == [1, 0, 0]
    assert c.mm_index.stats.hits == 1


def test_misses_of_one_step_are_deduplicated_across_requests() -> None:
    c = core(chunk_size=64)
    add(c, "a", 12, items=[item(1, 2, 4)])
    add(c, "b", 12, items=[item(1, 6, 4)])
    plan = run_step(c)
    assert [job.key[0] for job in plan.encode] == [1]


def test_cache_too_small_gives_transient_jobs() -> None:
    c = core(chunk_size=8, mm_cache_bytes=50, embedding_bytes_per_token=10)
    add(c, "a", 24, items=[item(1, 4, 12)])
    plans = [run_step(c) for _ in range(3)]
    # 12 tokens x 10 bytes never fit in 50 bytes: encoded for each chunk it overlaps, never cached.
    assert [[job.transient for job in p.encode] for p in plans] == [[True], [True], []]
    assert len(c.mm_index) == 0


def test_baseline_mode_encodes_every_image_in_the_first_chunk() -> None:
    c = core(chunk_size=16, mm_cache_mode="request")
    add(c, "a", 48, items=[item(1, 4, 8), item(2, 20, 8), item(3, 36, 8)])
    first = run_step(c)
    assert len(first.encode) == 1 and [it.hash[0] for it in first.encode[0].items] == [1, 2, 3]
    assert [len(run_step(c).encode) for _ in range(2)] == [0, 0]


def test_abort_frees_everything_and_tells_workers() -> None:
    c = core()
    add(c, "a", 10)
    run_step(c)
    assert c.abort("a")
    assert c.allocator.num_used == 0 and not c.running
    plan = c.schedule()
    assert plan is not None and plan.finished == ["a"] and plan.chunks == []


def test_prefix_cache_shares_computed_blocks_and_skips_their_prefill() -> None:
    c = core(enable_prefix_caching=True, chunk_size=64, num_blocks=16, block_size=4)
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks + 2
    c.add("a", prompt, 0, [], SamplingParams(max_tokens=2, temperature=0))
    run_step(c)
    run_step(c)  # a finishes; its blocks stay cached
    assert "a" not in c.seqs and c.allocator.num_cached >= 4
    longer = prompt + [40, 41, 42]
    c.add("b", longer, 0, [], SamplingParams(max_tokens=2, temperature=0))
    plan = run_step(c)
    [chunk] = plan.chunks
    assert (chunk.start, chunk.length) == (16, 5)  # 4 shared blocks: only the rest is computed
    assert c.allocator.prefix_hit_tokens == 16


def test_prefix_cache_never_shares_a_block_with_different_images() -> None:
    c = core(enable_prefix_caching=True, chunk_size=64, num_blocks=16, block_size=4)
    # Same text, different image: the span's pad values differ, so no block matches after it.
    a = [1, 2, 3, 4] + [1000] * 8 + [5, 6, 7, 8, 9]
    b = [1, 2, 3, 4] + [2000] * 8 + [5, 6, 7, 8, 9]
    c.add("a", a, 0, [item(1, 4, 8)], SamplingParams(max_tokens=1, temperature=0))
    run_step(c)
    c.add("b", b, 0, [item(2, 4, 8)], SamplingParams(max_tokens=1, temperature=0))
    plan = run_step(c)
    assert plan.chunks[0].start == 4  # only the text block before the image is shared
    assert [job.key[0] for job in plan.encode] == [2]


def test_prefix_blocks_are_recycled_when_memory_is_needed() -> None:
    c = core(enable_prefix_caching=True, chunk_size=64, num_blocks=6, block_size=4)
    c.add("a", list(range(1, 17)), 0, [], SamplingParams(max_tokens=1, temperature=0))
    run_step(c)
    assert c.allocator.num_cached == 4 and c.allocator.num_free == 6
    # A different prompt needing all 6 blocks takes the cached ones back.
    c.add("b", list(range(100, 120)), 0, [], SamplingParams(max_tokens=1, temperature=0))
    plan = run_step(c)
    assert plan.chunks[0].start == 0 and c.allocator.num_cached <= 5


def test_equal_pad_values_of_different_images_never_share_a_block() -> None:
    """Token ids alike to the last one (colliding pad values): only the full content hash in the block key
    tells the images apart."""
    c = core(enable_prefix_caching=True, chunk_size=64, num_blocks=16, block_size=4)
    ids = [1, 2, 3, 4] + [1000] * 8 + [5, 6, 7, 8, 9]
    c.add("a", ids, 0, [item(1, 4, 8)], SamplingParams(max_tokens=1, temperature=0))
    run_step(c)
    c.add("b", list(ids), 0, [item(2, 4, 8)], SamplingParams(max_tokens=1, temperature=0))
    plan = run_step(c)
    assert plan.chunks[0].start == 4
    c.add("c", list(ids), 0, [item(1, 4, 8)], SamplingParams(max_tokens=1, temperature=0))
    assert run_step(c).chunks[0].start == 16  # the same image again: every full block is shared


def test_each_shm_pointer_crosses_once_with_its_encode() -> None:
    from ipc.shm import ShmRef

    c = core(chunk_size=8)
    ref = ShmRef("glimpse-x-seg", 48, "float32", (4, 3))
    mm = MMItem(b"\x07" * 16, 4, 8, (1, 2, 16), ref)
    c.add("a", [1] * 16, 0, [mm], SamplingParams(max_tokens=1, temperature=0))
    first = run_step(c)  # tokens 0-7: the image starts here
    [new] = first.new_seqs
    assert all(it.pixels is None for it in new.items)  # the sequence's items travel without pointers
    assert [it.pixels for job in first.encode for it in job.items] == [ref]  # the encode carries it, once
    second = run_step(c)
    assert second.new_seqs == [] and second.encode == []


def test_prefill_stops_short_of_images_still_being_written() -> None:
    """Overlap of preprocessing and prefill: chunks run up to the first pending image, the sequence waits (blocks
    reserved, other requests go on), and resumes from there once `media_ready` names the image."""
    c = core(chunk_size=64)
    first, second = item(1, 4, 8), item(2, 20, 8)
    sampling = SamplingParams(max_tokens=2, temperature=0)
    c.add("a", [1] * 40, 0, [first, second], sampling, pending=[first.hash, second.hash])
    add(c, "b", 6)
    plan = run_step(c)
    assert [(ch.rid, ch.start, ch.length) for ch in plan.chunks] == [("a", 0, 4), ("b", 0, 6)]
    assert plan.encode == []  # no pixels of a pending image are read
    assert [(ch.rid, ch.length) for ch in run_step(c).chunks] == [("b", 1)]  # a waits; b decodes
    c.media_ready("a", [second.hash])  # out of order: the first image still blocks
    assert [(ch.rid, ch.length) for ch in run_step(c).chunks] == [("b", 1)]
    c.media_ready("a", [first.hash])
    plan = run_step(c)
    assert [(ch.rid, ch.start, ch.length, ch.sample) for ch in plan.chunks] == [("b", 8, 1, True), ("a", 4, 36, True)]
    assert [job.key for job in plan.encode] == [first.hash, second.hash]
    c.media_ready("gone", [first.hash])  # a request that ended meanwhile: nothing to do


def test_nothing_is_sampled_while_an_image_is_pending_even_from_the_prefix_cache() -> None:
    """A resent prompt whose pending image lies inside the cached prefix needs no pixels, but its first token must
    still wait for the image's report: the frontend learns of the request only then, and a MediaFailed must find
    nothing sent."""
    c = core(enable_prefix_caching=True, chunk_size=64, num_blocks=32, block_size=4)
    image = item(4, 4, 8)
    prompt = [1] * 4 + [900] * 8 + list(range(2, 14))  # 24 tokens, the image at 4..12
    c.add("first", prompt, 0, [image], SamplingParams(max_tokens=1, temperature=0))
    run_step(c)  # computes and caches the prompt's full blocks, image included
    c.add("again", prompt, 0, [image], SamplingParams(max_tokens=1, temperature=0), pending=[image.hash])
    plan = run_step(c)
    [chunk] = [ch for ch in plan.chunks if ch.rid == "again"]
    assert chunk.start >= 12 and chunk.start + chunk.length == 23 and not chunk.sample  # the last token waits
    assert c.schedule() is None
    c.media_ready("again", [image.hash])
    plan = run_step(c)
    assert [(ch.rid, ch.start, ch.length, ch.sample) for ch in plan.chunks] == [("again", 23, 1, True)]


def test_a_request_waiting_for_its_images_can_be_aborted() -> None:
    c = core(chunk_size=64)
    image = item(3, 0, 8)
    c.add("a", [1] * 20, 0, [image], SamplingParams(max_tokens=2, temperature=0), pending=[image.hash])
    assert c.schedule() is None  # admitted, blocks reserved, nothing to compute yet
    free = c.allocator.num_free
    assert c.abort("a")
    assert c.allocator.num_free > free and not c.has_work()


def _steps(c: SchedulerCore, n: int) -> list[tuple[list[tuple[str, int, int]], list[int]]]:
    out = []
    for _ in range(n):
        plan = run_step(c)
        out.append(([(ch.rid, ch.start, ch.length) for ch in plan.chunks],
                    [it.hash[0] for job in plan.encode for it in job.items]))
    return out


def test_a_step_with_decodes_encodes_images_up_to_its_image_token_cap() -> None:
    c = core(chunk_size=64, decode_step_image_tokens=12, mm_cache_bytes=100_000)
    add(c, "a", 8, max_tokens=20)
    run_step(c)  # a decodes from now on
    # b: text, three images of 10 tokens, text; each step with a's decode may encode 12 image tokens, so one image
    shown = [item(1, 4, 10), item(2, 14, 10), item(3, 24, 10)]
    add(c, "b", 40, shown)
    assert _steps(c, 4) == [
        ([("a", 8, 1), ("b", 0, 14)], [1]),  # up to the second image
        ([("a", 9, 1), ("b", 14, 10)], [2]),
        ([("a", 10, 1), ("b", 24, 16)], [3]),  # the last image and the text after it
        ([("a", 11, 1), ("b", 40, 1)], []),
    ]


def test_the_image_token_cap_lets_one_large_image_through_and_spares_cached_ones() -> None:
    c = core(chunk_size=64, decode_step_image_tokens=4, mm_cache_bytes=100_000)
    add(c, "a", 8, max_tokens=20)
    run_step(c)
    add(c, "b", 30, [item(1, 2, 10), item(2, 12, 10)])
    first = run_step(c)  # the first image is larger than the cap: it goes alone
    assert [(ch.rid, ch.length) for ch in first.chunks] == [("a", 1), ("b", 12)]
    assert [it.hash[0] for job in first.encode for it in job.items] == [1]
    # b's second image goes alone again (with the text after it); c shows b's first image (cached, free) and a new
    # one, which waits for the next step
    add(c, "c", 30, [item(1, 2, 10), item(4, 14, 10)])
    second = run_step(c)
    assert [(ch.rid, ch.length) for ch in second.chunks] == [("a", 1), ("b", 18), ("c", 14)]
    assert [it.hash[0] for job in second.encode for it in job.items] == [2]


def test_without_decodes_the_image_token_cap_does_not_apply() -> None:
    c = core(chunk_size=64, decode_step_image_tokens=12, mm_cache_bytes=100_000)
    add(c, "b", 40, [item(1, 4, 10), item(2, 14, 10), item(3, 24, 10)])
    plan = run_step(c)
    assert [(ch.rid, ch.length) for ch in plan.chunks] == [("b", 40)]
    assert sorted(it.hash[0] for job in plan.encode for it in job.items) == [1, 2, 3]


def test_encodes_cost_a_step_with_decodes_part_of_its_budget() -> None:
    c = core(chunk_size=64, encode_token_cost=2.0, mm_cache_bytes=100_000)
    add(c, "a", 8, max_tokens=20)
    run_step(c)  # a decodes from now on: 63 tokens of budget are left a step
    add(c, "b", 40, [item(1, 4, 10), item(2, 14, 10), item(3, 24, 10)])
    assert _steps(c, 3) == [
        # images 1 and 2 cost 40: 23 tokens are left, which reach into image 2; image 3 (20 more) would not fit
        ([("a", 8, 1), ("b", 0, 23)], [1, 2]),
        ([("a", 9, 1), ("b", 23, 17)], [3]),  # the prompt's rest
        ([("a", 10, 1), ("b", 40, 1)], []),
    ]


def test_an_image_costlier_than_the_budget_goes_alone_with_its_first_token() -> None:
    c = core(chunk_size=64, encode_token_cost=10.0, mm_cache_bytes=100_000)
    add(c, "a", 8, max_tokens=20)
    run_step(c)
    add(c, "b", 30, [item(1, 2, 10), item(2, 12, 10)])
    assert _steps(c, 3) == [
        ([("a", 8, 1), ("b", 0, 3)], [1]),  # the text before it and one of its tokens; nothing else this step
        ([("a", 9, 1), ("b", 3, 10)], [2]),  # image 1's cached rest, then image 2 alone
        ([("a", 10, 1), ("b", 13, 17)], []),
    ]


def test_an_image_over_the_budget_waits_for_a_step_without_other_prefill() -> None:
    c = core(chunk_size=64, encode_token_cost=2.0, mm_cache_bytes=100_000)
    add(c, "a", 8, max_tokens=20)
    run_step(c)
    add(c, "b", 40, [item(1, 0, 30)], max_tokens=20)
    add(c, "c", 30, [item(2, 0, 20)])
    assert _steps(c, 3) == [
        ([("a", 8, 1), ("b", 0, 3)], [1]),  # b's image costs 60 of 63
        # b's cached rest leaves 26 of the budget, c's image costs 40: c waits rather than go on top of b's chunk
        ([("a", 9, 1), ("b", 3, 37)], []),
        ([("a", 10, 1), ("b", 40, 1), ("c", 0, 22)], [2]),  # only decodes before it: c's image goes
    ]


def test_without_decodes_encodes_cost_nothing() -> None:
    c = core(chunk_size=64, encode_token_cost=2.0, mm_cache_bytes=100_000)
    add(c, "b", 40, [item(1, 4, 10), item(2, 14, 10), item(3, 24, 10)])
    assert _steps(c, 1) == [([("b", 0, 40)], [1, 2, 3])]


def test_encode_ahead_takes_later_images_and_the_waiting_head_once() -> None:
    c = core(chunk_size=16, max_num_seqs=2, encode_ahead_tokens=10, mm_cache_bytes=100_000)
    add(c, "a", 8, max_tokens=20)
    run_step(c)  # a decodes from now on: 15 tokens a step for b
    add(c, "b", 40, [item(1, 4, 10), item(2, 14, 10), item(3, 24, 10)])
    add(c, "c", 20, [item(4, 2, 10)])  # waits: two sequences run at most
    steps = []
    for _ in range(4):
        plan = run_step(c)
        keys = [it.hash[0] for job in plan.encode for it in job.items]
        cut = len(keys) - plan.encode_ahead
        steps.append(([(ch.rid, ch.start, ch.length) for ch in plan.chunks], keys[:cut], keys[cut:]))
    assert steps == [
        # b's chunk reads images 1 and 2; the next image past it goes ahead (the budget: one 10-token image)
        ([("a", 8, 1), ("b", 0, 15)], [1, 2], [3]),
        # image 3 is cached: nothing of b's to encode, so the waiting head's image goes ahead
        ([("a", 9, 1), ("b", 15, 15)], [], [4]),
        ([("a", 10, 1), ("b", 30, 10)], [], []),
        ([("a", 11, 1), ("b", 40, 1)], [], []),
    ]
    assert c.images_ahead == 2 and c.images_planned == 4  # every image once


def test_encode_ahead_skips_pending_pixels_and_stays_within_its_budget() -> None:
    c = core(chunk_size=8, encode_ahead_tokens=12, mm_cache_bytes=100_000)
    add(c, "b", 60, [item(1, 2, 6), item(2, 10, 6), item(3, 20, 6), item(4, 30, 6)])
    c.waiting[0].pending.add(item(3, 20, 6).hash)  # image 3's pixels are still being written
    plan = run_step(c)  # chunk [0, 8): image 1 now; ahead: image 2 and (3 pending) image 4, 12 tokens
    keys = [it.hash[0] for job in plan.encode for it in job.items]
    assert keys == [1, 2, 4] and plan.encode_ahead == 2


def test_without_a_budget_nothing_is_encoded_ahead() -> None:
    c = core(chunk_size=8, mm_cache_bytes=100_000)
    add(c, "b", 40, [item(1, 2, 6), item(2, 10, 6)])
    plan = run_step(c)
    assert [it.hash[0] for job in plan.encode for it in job.items] == [1] and plan.encode_ahead == 0
