"""Segment reuse across tokenizer workers, in-process: two workers share /dev/shm like two tokenizer processes, so
one links the live segment the other wrote, falls back to another live name when its own hint is stale, and
writes again when no copy is left; a request refused after linking unlinks what it linked."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from ipc.control import RequestFailed
from ipc.requests import GenerateRequest
from ipc.shm import ShmSegment, find_segments, link_segment, list_segments, segment_name
from tests.workers.tokenizer.harness import chat_body, handle, inodes, png, server_config, shm_path
from workers.tokenizer.worker import TokenizerWorker


def test_reuse_across_workers_and_fallback(demo_model_dir: Path, launch_id: str) -> None:
    config = server_config(demo_model_dir, launch_id)
    log = logging.getLogger("test")
    a, b = TokenizerWorker(config, 0, log), TokenizerWorker(config, 1, log)
    try:
        raw = png(64, 64, seed=5)
        body = chat_body([raw, raw])  # the same image twice: one segment, one name
        ra = handle(a, "a1", body)
        pixels = ra.items[0].pixels
        assert pixels is not None and len(ra.shm_names) == 1 and ra.items[1].pixels == pixels
        assert ra.shm_bytes == pixels.nbytes
        assert a.images_reused == 1

        rb = handle(b, "b1", body)  # b never saw it: found by listing /dev/shm, grid read from the name
        assert rb.shm_bytes == 0 and b.images_reused == 2 and inodes(rb) == inodes(ra)
        assert rb.input_ids == ra.input_ids and rb.items[0].pixels is not None
        with ShmSegment.attach(rb.items[0].pixels) as seg:  # the frame of its grid, channels-last
            assert seg.tensor().shape == (rb.items[0].grid[1] * 14, rb.items[0].grid[2] * 14, 3)  # [H, W, C]

        ShmSegment.unlink(ra.shm_names[0])  # a's request finished: a's own hint is now stale
        ra2 = handle(a, "a2", body)  # ... so a links b's name instead
        assert ra2.shm_bytes == 0 and inodes(ra2) == inodes(rb)

        for name in rb.shm_names + ra2.shm_names:
            ShmSegment.unlink(name)
        rb2 = handle(b, "b2", body)  # no live copy anywhere: decoded, processed and written again
        assert rb2.shm_bytes > 0 and rb2.input_ids == ra.input_ids
        for name in rb2.shm_names:
            ShmSegment.unlink(name)
    finally:
        a.close()
        b.close()


def test_link_and_find_segments(launch_id: str) -> None:
    src = segment_name(launch_id, "abc-1")
    seg, _ = ShmSegment.create_from_tensor(src, torch.arange(4.0))
    seg.close()
    dst = segment_name(launch_id, "abc-2")
    assert link_segment(src, dst)
    assert os.stat(shm_path(src)).st_ino == os.stat(shm_path(dst)).st_ino
    assert find_segments(launch_id, "abc-") == [src, dst] and find_segments(launch_id, "x") == []
    with pytest.raises(FileExistsError):
        link_segment(src, dst)
    assert ShmSegment.unlink(src) and ShmSegment.unlink(dst)
    assert not link_segment(src, segment_name(launch_id, "abc-3"))
    assert list_segments(launch_id) == []


def test_refusal_after_linking_unlinks_the_requests_names(demo_model_dir: Path, launch_id: str) -> None:
    config = server_config(demo_model_dir, launch_id)
    worker = TokenizerWorker(config, 0, logging.getLogger("test"))
    try:
        seen, new = png(64, 64, seed=7), png(96, 64, seed=8)
        first = handle(worker, "r1", chat_body([seen]))
        # Room for a little, not for the new image: the live one is linked first, then the budget
        # check refuses the request, and the link made for it must go again.
        worker.shm_bytes = worker.shm_budget - 1
        result = worker.handle(GenerateRequest("r2", chat_body([seen, new]), time.time()))
        assert isinstance(result, RequestFailed) and (result.status, result.code) == (
            503,
            "shm_budget_exceeded",
        )
        assert list_segments(launch_id) == first.shm_names
        # An image that could never fit the budget is the client's problem (400), not overload.
        worker.shm_bytes, worker.shm_budget = 0, 1000
        result = worker.handle(GenerateRequest("r3", chat_body([new]), time.time()))
        assert isinstance(result, RequestFailed) and (result.status, result.code) == (400, "images_too_large")
        assert list_segments(launch_id) == first.shm_names
        ShmSegment.unlink(first.shm_names[0])
    finally:
        worker.close()
