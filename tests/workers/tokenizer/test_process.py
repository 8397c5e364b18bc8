"""Tokenizer worker: a real spawned process on real sockets and /dev/shm, checked against MMProcessor
run in-process on the same images (segment reuse across workers: test_segment_reuse.py; a request's fresh
images on the thread pool: media/test_image_prep.py; the shared helpers: harness.py)."""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from pathlib import Path

import msgspec
import torch

from ipc.control import AbortRequest, ProcessReady, RequestFailed, Shutdown
from ipc.prompts import MediaFailed, MediaReady, TokenizedRequest
from ipc.requests import GenerateRequest, RequestAccepted
from ipc.shm import ShmSegment, list_segments
from ipc.stats import SchedulerStats, TokenizerStats
from tests.workers.tokenizer.harness import MODEL, Peer, chat_body, png, server_config, shm_path
from workers.engine.prompt.processor import MMProcessor
from workers.tokenizer.media.fetch import decode_image
from workers.tokenizer.process import run_tokenizer
from workers.tokenizer.requests.chat import parse_request, to_sampling_params
from workers.tokenizer.requests.chat_prompt import template_messages


def test_tokenizer_process(demo_model_dir: Path, launch_id: str) -> None:
    config = server_config(demo_model_dir, launch_id)
    peer = Peer(launch_id)
    proc = multiprocessing.get_context("spawn").Process(target=run_tokenizer, args=(config, 0), daemon=True)
    proc.start()
    try:
        ready = peer.expect(ProcessReady, timeout_s=120)
        assert (ready.role, ready.index, ready.pid) == ("tokenizer", 0, proc.pid)

        raws = [png(64, 48, seed=1), png(56, 90, seed=2)]
        body = chat_body(raws, temperature=0, stream=True, stream_options={"include_usage": True})
        peer.tok.send(GenerateRequest("r1", body, time.time()))
        # Fresh images of a request alone in the tokenizer: the prompt goes to the scheduler before their pixels
        # (grids from their headers); the frontend's answer once they are all written. (Under load the first is
        # written before: test_tokenizer_service.py.)
        first = peer.scheduled()
        assert first.pending == [item.hash for item in first.items]
        accepted = peer.expect(RequestAccepted)

        # The same prompt built in-process from the same bytes.
        mm = MMProcessor(demo_model_dir)
        processed = [
            mm.process_image(decode_image(raw, 10**6), image_hash=mm.media_hash(raw)) for raw in raws
        ]
        chat = parse_request(body)
        prompt = mm.build(mm.render(template_messages(chat)), processed)
        assert accepted == RequestAccepted("r1", True, True, MODEL, len(prompt.input_ids), 0)
        assert first.rid == "r1"
        assert first.input_ids == prompt.input_ids
        assert first.mrope_delta == prompt.mrope_delta
        assert [(i.hash, i.offset, i.length, i.grid) for i in first.items] == [
            (s.hash, s.offset, s.length, s.grid) for s in prompt.spans
        ]
        assert first.sampling == to_sampling_params(chat, len(prompt.input_ids), 4096)
        assert sorted(first.shm_names) == sorted(i.pixels.name for i in first.items if i.pixels)
        # Segments hold uint8 frames; made into rows as a model worker makes them, they are the processor's rows.
        assert mm.uint8_frames is not None
        layout = mm.uint8_frames[0]
        assert first.shm_bytes == sum(math.prod(layout.shape(p.grid)) for p in processed)
        for item, expected in zip(first.items, processed):
            assert item.pixels is not None and item.pixels.dtype == "uint8"
            with ShmSegment.attach(item.pixels) as seg:
                assert torch.equal(layout.rows(seg.tensor(), torch.float32), expected.pixel_values)

        # Resent images: hard links to the live segments, nothing decoded or written.
        peer.tok.send(GenerateRequest("r2", body, time.time()))
        peer.expect(RequestAccepted)
        second = peer.scheduled()
        assert second.input_ids == first.input_ids and second.shm_bytes == 0 and second.pending == []
        assert set(second.shm_names).isdisjoint(first.shm_names)
        for a, b in zip(first.items, second.items):
            assert a.pixels is not None and b.pixels is not None
            assert os.stat(shm_path(a.pixels.name)).st_ino == os.stat(shm_path(b.pixels.name)).st_ino
            assert (
                msgspec.structs.replace(b.pixels, name=a.pixels.name) == a.pixels
            )  # same nbytes/dtype/shape
        stats = _stats_after(peer, requests=2)
        assert (stats.worker, stats.images, stats.images_reused, stats.images_deferred) == (0, 4, 2, 2)

        # Refusals: OpenAI-shaped errors to the frontend, nothing to the scheduler, no shm left behind.
        bad = [
            ("r3", chat_body(raws, temperature=5), 400, "temperature", "invalid_value"),
            ("r4", chat_body(raws).replace(b'"demo"', b'"gpt-4o"'), 404, "model", "model_not_found"),
            (
                "r5",
                chat_body([raws[0], b"not an image"]),
                400,
                "messages[0].content[2].image_url",
                "invalid_image",
            ),
            ("r6", b"{not json", 400, None, "invalid_json"),
        ]
        for rid, bad_body, *_ in bad:
            peer.tok.send(GenerateRequest(rid, bad_body, time.time()))
        # Requests are prepared concurrently: answers come in any order.
        answers = {f.rid: f for f in (peer.expect(RequestFailed) for _ in bad)}
        for rid, _, status, param, code in bad:
            failed = answers[rid]
            assert (failed.rid, failed.status, failed.param, failed.code) == (rid, status, param, code)
        assert peer.sched.recv(300) is None
        assert sorted(list_segments(launch_id)) == sorted(first.shm_names + second.shm_names)

        # Back-pressure: the scheduler reports the budget spent, new images are refused with 503.
        fields = {f: 0 for f in SchedulerStats.__struct_fields__ if f not in ("workers", "encoders")}
        peer.tok.send(SchedulerStats(**{**fields, "shm_bytes": 100, "shm_budget_bytes": 100}))
        peer.tok.send(GenerateRequest("r7", chat_body([png(30, 30, seed=9)]), time.time()))
        failed = peer.expect(RequestFailed)
        assert failed.rid == "r7" and failed.type == "server_error"
        assert (failed.status, failed.code) == (503, "shm_budget_exceeded")

        # The scheduler's job at the end of a request: unlink its names. Then a clean exit.
        for name in first.shm_names + second.shm_names:
            assert ShmSegment.unlink(name)
        peer.tok.send(Shutdown("test over"))
        proc.join(30)
        assert proc.exitcode == 0
        assert list_segments(launch_id) == []
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        peer.close()


def truncated_png(width: int, height: int, seed: int) -> bytes:
    """A PNG whose header is whole and whose pixel data stops halfway: only a full decode finds it corrupt."""
    raw = png(width, height, seed)
    return raw[: len(raw) // 2]


def test_corrupt_later_image_fails_cleanly_after_the_prompt_went_out(demo_model_dir: Path, launch_id: str) -> None:
    """Overlap of preprocessing and prefill: the third image's header is fine, so the prompt reaches the
    scheduler before its pixels are decoded (a lone request: before any image is written); the decode then fails.
    The frontend gets a 400 naming the image (never a RequestAccepted), the scheduler a MediaFailed, and the only
    names left are those the scheduler was told of (its to unlink); a client leaving mid-write ends the same way."""
    config = server_config(demo_model_dir, launch_id)
    peer = Peer(launch_id)
    proc = multiprocessing.get_context("spawn").Process(target=run_tokenizer, args=(config, 0), daemon=True)
    proc.start()
    try:
        peer.expect(ProcessReady, timeout_s=120)
        good = [png(64, 48, seed=11), png(56, 90, seed=12)]
        peer.tok.send(GenerateRequest("c1", chat_body([*good, truncated_png(640, 480, seed=13)]), time.time()))
        sent = peer.sched.recv(10_000)
        assert isinstance(sent, TokenizedRequest) and sent.pending == [i.hash for i in sent.items], sent
        reported: set[bytes] = set()
        while not isinstance(msg := peer.sched.recv(10_000), MediaFailed):
            assert isinstance(msg, MediaReady) and msg.rid == "c1", msg
            reported.update(msg.hashes)
        assert msg.rid == "c1" and sent.items[2].hash not in reported
        failed = peer.expect(RequestFailed)
        assert (failed.rid, failed.status, failed.code) == ("c1", 400, "invalid_image")
        assert failed.param == "messages[0].content[3].image_url"
        # The writes are stopped and the tokenizer's names unlinked before it answers the next request.
        peer.tok.send(GenerateRequest("c2", chat_body([]), time.time()))
        peer.expect(RequestAccepted)
        assert peer.scheduled().rid == "c2"
        told = sorted(i.pixels.name for i in sent.items if i.pixels is not None and i.hash in reported)
        assert sorted(list_segments(launch_id)) == told
        for name in told:  # the scheduler's part
            ShmSegment.unlink(name)

        # The client leaves while a big second image is still being decoded: same clean end, nothing left behind.
        big = png(1920, 1080, seed=14)
        peer.tok.send(GenerateRequest("c3", chat_body([png(32, 32, seed=15), big]), time.time()))
        sent = peer.sched.recv(10_000)
        assert isinstance(sent, TokenizedRequest) and sent.pending == [i.hash for i in sent.items], sent
        peer.tok.send(AbortRequest("c3"))
        reported = set()
        while reported != set(sent.pending) and isinstance(msg := peer.sched.recv(10_000), MediaReady):
            reported.update(msg.hashes)
        for item in sent.items:  # the names the scheduler was told of are its to unlink
            if item.hash in reported and item.pixels is not None:
                ShmSegment.unlink(item.pixels.name)
        if reported == set(sent.pending):  # the decodes won the race
            assert peer.expect(RequestAccepted).rid == "c3"
        else:
            assert msg == MediaFailed("c3")
            assert peer.expect(RequestFailed).status == 499
            peer.tok.send(GenerateRequest("c4", chat_body([]), time.time()))
            peer.expect(RequestAccepted)
            peer.scheduled()
        assert list_segments(launch_id) == []
        peer.tok.send(Shutdown("test over"))
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        peer.close()


def _stats_after(peer: Peer, requests: int) -> TokenizerStats:
    """The first stats report covering `requests` requests (reports come after each request)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for s in peer.stats:
            if s.requests >= requests:
                return s
        msg = peer.frontend.recv(200)
        if isinstance(msg, TokenizerStats):
            peer.stats.append(msg)
        else:
            assert msg is None, msg
    raise AssertionError(f"no stats with {requests} requests: {peer.stats}")
