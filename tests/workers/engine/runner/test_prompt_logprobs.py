"""Prompt log probabilities: the worker's scoring in slices of rows, the scheduling core's handling of requests
that ask for them (no prefix-cache hits, max_tokens 0, batches of prompts) and the scheduler's book that
collects them chunk by chunk."""

from __future__ import annotations

from array import array

import pytest
import torch

from ipc.logprob_messages import PromptLogprobs
from ipc.prompts import SamplingParams
from ipc.steps import StepResult
from workers.engine.core.scheduler import SchedulerCore
from workers.engine.runner import prompt_logprobs
from workers.engine.runner.prompt_logprobs import PromptSpan, score_prompts
from workers.scheduler.logprobs import LogprobRenderer, PromptLogprobBook

VOCAB, HIDDEN = 50, 8


def _reference(hidden: torch.Tensor, head: torch.Tensor, targets: list[int]) -> torch.Tensor:
    return torch.log_softmax(hidden @ head.T, dim=-1)[torch.arange(len(targets)), torch.tensor(targets)]


def test_scores_equal_one_log_softmax_whatever_the_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    hidden = torch.randn(7, HIDDEN, generator=gen)
    targets = [int(t) for t in torch.randint(0, VOCAB, (7,), generator=gen)]
    spans = [PromptSpan("a", 0, targets[:4], 3, 0), PromptSpan("b", 5, targets[4:], 0, 4)]
    calls: list[int] = []

    def logits_of(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ head.T

    monkeypatch.setattr(prompt_logprobs, "MAX_SLICE_ROWS", 3)  # slices cross the spans' boundary
    scored = score_prompts(hidden, spans, logits_of, VOCAB, rank0=True)
    assert scored is not None
    a, b = scored.entries()
    assert calls == [3, 3, 1]
    expected = _reference(hidden, head, targets)
    assert a.rid == "a" and a.start == 0 and b.rid == "b" and b.start == 5
    assert a.logprobs + b.logprobs == pytest.approx(expected.tolist(), abs=1e-5)
    full = torch.log_softmax(hidden @ head.T, dim=-1)
    for row, (ids, values, rank) in enumerate(zip(a.top_ids, a.top_logprobs, a.ranks, strict=True)):
        assert ids == full[row].topk(3).indices.tolist()
        assert values == pytest.approx(full[row].topk(3).values.tolist(), abs=1e-5)
        assert rank == 1 + int((full[row] > full[row, targets[row]]).sum())
    assert b.top_ids == [[], [], []] and len(b.ranks) == 3
    # Other TP ranks take part in every logits call (a collective there) and report nothing.
    calls.clear()
    assert score_prompts(hidden, spans, logits_of, VOCAB, rank0=False) is None
    assert calls == [3, 3, 1]



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scoring_does_not_make_the_host_wait_on_cuda() -> None:
    """On CUDA the scores reach the host by queued copies: no call in scoring synchronizes with the device (the
    worker plans the next step meanwhile), and the entries read afterwards are the CPU's."""
    gen = torch.Generator().manual_seed(1)
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    hidden = torch.randn(7, HIDDEN, generator=gen)
    targets = [int(t) for t in torch.randint(0, VOCAB, (7,), generator=gen)]
    spans = [PromptSpan("a", 0, targets[:4], 3, 0), PromptSpan("b", 5, targets[4:], 0, 4)]
    want = score_prompts(hidden, spans, lambda h: h @ head.T, VOCAB, rank0=True)
    on_device, cuda_head = hidden.cuda(), head.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
    try:
        got = score_prompts(on_device, spans, lambda h: h @ cuda_head.T, VOCAB, rank0=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got is not None and want is not None
    for a, b in zip(got.entries(), want.entries(), strict=True):
        assert (a.rid, a.start, a.ranks, a.top_ids) == (b.rid, b.start, b.ranks, b.top_ids)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def _core(prefix_caching: bool = True) -> SchedulerCore:
    return SchedulerCore(
        num_blocks=64, block_size=4, chunk_size=8, max_num_seqs=8, max_model_len=256, mm_cache_bytes=0,
        embedding_bytes_per_token=1, eos_token_ids=(0,), enable_prefix_caching=prefix_caching,
    )


def _run(core: SchedulerCore, token: int = 5) -> list[tuple[str, int | None, str | None]]:
    """Steps until idle, sampling ``token`` everywhere; every update as (rid, token, finish reason)."""
    seen = []
    while (plan := core.schedule()) is not None:
        result = StepResult(plan.step_id, [(c.rid, token) for c in plan.chunks if c.sample])
        seen += [(u.rid, u.token_id, u.finish_reason) for u in core.update(result)]
    return seen


def test_prompt_logprobs_take_no_prefix_hits_but_publish_their_blocks() -> None:
    core = _core()
    prompt = list(range(1, 21))
    core.add("first", prompt, 0, [], SamplingParams(max_tokens=1, prompt_logprobs=1))
    _run(core)
    core.add("again", prompt, 0, [], SamplingParams(max_tokens=1, prompt_logprobs=1))
    plan = core.schedule()
    assert plan is not None and plan.chunks[0].start == 0 and core.seqs["again"].cached_tokens == 0
    core.update(StepResult(plan.step_id, []))
    core.abort("again")
    core.add("plain", prompt, 0, [], SamplingParams(max_tokens=1))
    core.schedule()
    assert core.seqs["plain"].cached_tokens == 16  # "first" published its full blocks


def test_max_tokens_zero_computes_the_prompt_and_samples_nothing() -> None:
    core = _core()
    core.add("r", list(range(1, 20)), 0, [], SamplingParams(max_tokens=0, n=2, prompt_logprobs=0))
    plans = []
    seen = []
    while (plan := core.schedule()) is not None:
        plans.append(plan)
        seen += [(u.rid, u.token_id, u.finish_reason, u.index) for u in core.update(StepResult(plan.step_id, []))]
    assert not any(c.sample for p in plans for c in p.chunks) and not any(p.forks for p in plans)
    assert sum(c.length for p in plans for c in p.chunks) == 19
    assert seen == [("r", None, "length", 0), ("r/1", None, "length", 1)]
    assert not core.has_work() and core.allocator.num_used == 0


def test_a_batch_of_prompts_is_one_request_of_several_sequences() -> None:
    core = _core()
    finished = []
    core.on_finished = lambda seq: finished.append(seq.request_id)
    core.add("b", [1, 2, 3], 0, [], SamplingParams(max_tokens=2), more_prompts=[[4, 5], [6, 7, 8, 9]])
    updates = _run(core)
    assert sorted({rid for rid, _, _ in updates}) == ["b", "b/1", "b/2"]
    assert finished == ["b"]  # once, with its last sequence
    with pytest.raises(ValueError, match="n = 1"):
        core.add("c", [1], 0, [], SamplingParams(n=2), more_prompts=[[2]])
    core.add("d", [1, 2], 0, [], SamplingParams(max_tokens=1), more_prompts=[[3]])
    assert core.abort("d") and not core.seqs


class _Tokenizer:
    def convert_ids_to_tokens(self, token_id: int) -> str:
        return f"t{token_id}"


def test_the_book_renders_each_choice_once_and_a_recompute_replaces_positions() -> None:
    book = PromptLogprobBook(LogprobRenderer(_Tokenizer()))
    book.expect("r", [[10, 11, 12, 13]], SamplingParams(n=2, prompt_logprobs=1))
    book.collect([PromptLogprobs("r", 0, [-1.0, -2.0], [1, 3], [[11], [7]], [[-1.0], [-0.5]])])
    # Preempted and recomputed from the start: the positions come again and replace the first report.
    book.collect([PromptLogprobs("r", 0, [-1.5], [2], [[4]], [[-0.1]])])
    book.collect([PromptLogprobs("r", 1, [-2.5, -3.0], [3, 4], [[7], [8]], [[-0.2], [-0.3]])])
    first = book.take("r")
    assert first is not None
    # Packed for the frontend (ipc/logprob_messages.py PromptLogprob): position 0 has no entry; float32 values.
    assert array("i", first.token_ids).tolist() == [10, 11, 12, 13]
    assert array("f", first.logprobs).tolist() == pytest.approx([-1.5, -2.5, -3.0])
    assert array("i", first.ranks).tolist() == [2, 3, 4] and first.k == 1
    assert array("i", first.top_ids).tolist() == [4, 7, 8]
    assert array("f", first.top_logprobs).tolist() == pytest.approx([-0.1, -0.2, -0.3])
    texts = dict(zip(array("i", first.vocab_ids).tolist(), first.texts, strict=True))
    assert {i: texts[i] for i in (4, 10, 11, 12, 13)} == {i: f"t{i}" for i in (4, 10, 11, 12, 13)}
    assert book.take("r") is None and book.take("r/1") == first  # each choice once, the prompt shared
    assert not book._packed and not book._owner
    book.expect("s", [[1, 2], [3, 4]], SamplingParams(prompt_logprobs=0))
    book.drop("s")
    assert not book._packed and not book._owner and not book._readers
    book.expect("u", [[1, 2]], SamplingParams())  # not asked for: nothing kept
    assert book.take("u") is None and not book._packed
