"""Which steps wait for the ahead encodes still running on the side stream (runner/ahead_encodes.py): only those that
splice, evict or spill an entry being written. CPU: the keys a plan reads, and the decision over them (the stream
and its events are exercised on CUDA by test_ahead_encodes.py)."""

from __future__ import annotations

import pytest
import torch

from ipc.prompts import MMItem, SamplingParams
from ipc.steps import EncodeItem, EncodeJob, NewSeq, SeqChunk, StepPlan
from workers.engine.runner.ahead_encodes import AheadEncodes, store_reads
from workers.engine.runner.step_inputs import WorkerSeq

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def _item(key: bytes, offset: int, length: int) -> MMItem:
    return MMItem(key, offset, length, (1, 2, length // 2 * 2))


def _seq(rid: str, items: list[MMItem], mm_key: bytes = b"") -> WorkerSeq:
    return WorkerSeq(rid, [0] * 40, [[], [], []], 0, items, SamplingParams(), mm_key, [0] * len(items))


def _chunk(rid: str, start: int, length: int) -> SeqChunk:
    return SeqChunk(rid, start, length, [], [], sample=False)


def _plan(chunks: list[SeqChunk], new: list[NewSeq] | None = None, evict: list[bytes] | None = None,
          spill: list[bytes] | None = None) -> StepPlan:
    return StepPlan(1, new or [], chunks, evict or [], [], [], mm_spill=spill or [])


def test_a_chunk_reads_the_images_its_span_overlaps() -> None:
    seqs = {"r": _seq("r", [_item(A, 4, 8), _item(B, 20, 8)])}
    assert store_reads(_plan([_chunk("r", 0, 4)]), seqs) == set()  # text before the first image
    assert store_reads(_plan([_chunk("r", 0, 5)]), seqs) == {A}
    assert store_reads(_plan([_chunk("r", 11, 10)]), seqs) == {A, B}  # the last row of one, the first of the next
    assert store_reads(_plan([_chunk("r", 12, 8)]), seqs) == set()  # between them
    assert store_reads(_plan([_chunk("r", 40, 1)]), seqs) == set()  # a decode
    assert store_reads(_plan([_chunk("gone", 0, 40)]), seqs) == set()


def test_new_sequences_the_per_request_key_evictions_spills_and_encodes_count() -> None:
    new = NewSeq("n", [0] * 30, 0, [_item(C, 2, 6)], SamplingParams())
    assert store_reads(_plan([_chunk("n", 0, 16)], new=[new]), {}) == {C}
    whole = {"w": _seq("w", [_item(A, 0, 4), _item(B, 8, 4)], mm_key=C)}  # --mm-cache-mode request: one entry
    assert store_reads(_plan([_chunk("w", 8, 2)]), whole) == {C}
    assert store_reads(_plan([], evict=[A], spill=[B]), {}) == {A, B}
    job = EncodeJob(C, [EncodeItem(C, (1, 2, 2), 1)])
    assert store_reads(StepPlan(1, [], [], [], [job], []), {}) == {C}


def test_only_a_step_that_needs_an_entry_being_written_waits() -> None:
    ahead = AheadEncodes(encoder=None, device=torch.device("cpu"))  # type: ignore[arg-type]
    assert not ahead.needs_wait({A})  # nothing pending
    ahead.pending = {A, B}
    assert ahead.needs_wait({B, C}) and not ahead.needs_wait({C}) and not ahead.needs_wait(set())
    asked: list[int] = []
    ahead.wait(lambda: asked.append(1) or {A})  # no ahead encode on a stream: the keys are not even computed
    assert asked == [] and ahead.waits == 0


def test_ahead_encodes_refuse_tensor_parallel_ranks() -> None:
    with pytest.raises(ValueError, match="encode_ahead_tokens needs tp 1"):
        AheadEncodes(encoder=None, device=torch.device("cpu"), tokens=4096, tp_size=2)  # type: ignore[arg-type]
    assert AheadEncodes(encoder=None, device=torch.device("cpu"), tokens=0, tp_size=2).stream is None  # type: ignore[arg-type]
