"""The harness of the scheduler process tests (test_process.py): a scheduler and a model worker (and encoder workers,
tests/workers/encoder/) spawned as real processes, and the sockets the test uses to play the frontend and a tokenizer.

``Stack.request`` builds a TokenizedRequest with the engine's MMProcessor and writes its pixels to shm itself, the
way the tokenizer worker does; ``Stack.collect`` reads the frontend's side until the given requests end.
``start_stack`` waits for the scheduler's ready message, ``stop_stack`` shuts both children down and checks
they leave no segment behind.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq
from PIL import Image

from ipc.channels import PullSocket, PushSocket, new_context
from ipc.control import ProcessReady, RequestFailed, Shutdown
from ipc.inbound import FrontendInbound, SchedulerInbound, TokenizerInbound
from ipc.launch import cleanup_launch_dir, ipc_address, new_launch_id
from ipc.outputs import OutputBatch, RequestOutput
from ipc.prompts import MMItem, SamplingParams, TokenizedRequest
from ipc.shm import SHM_DIR, ShmRef, ShmSegment, link_segment, list_segments, segment_name, sweep
from ipc.stats import SchedulerStats
from server.config import ServerConfig
from tests.conftest import noise_image
from workers.encoder.process import run_encoder_worker
from workers.engine.config import EngineConfig
from workers.engine.offline import images_in
from workers.engine.prompt.processor import MMProcessor
from workers.model.process import run_model_worker
from workers.scheduler.process import run_scheduler

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
SHORT = msgspec.structs.replace(GREEDY, max_tokens=2)
LONG = msgspec.structs.replace(GREEDY, max_tokens=1000)  # runs until aborted
TIMEOUT_S = 180.0
SHM_BUDGET = 10 << 20
TWO_IMAGES = [noise_image(300, 200, seed=1), noise_image(123, 77, seed=2)]


def chat(text: str, images: list[Image.Image]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def shm_ref(name: str, pixels: torch.Tensor) -> ShmRef:
    return ShmRef(name, pixels.nbytes, "float32", tuple(pixels.shape))


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def wait_for(cond: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@dataclass
class Stack:
    """The two children plus the sockets the test uses to play frontend and tokenizer."""

    config: ServerConfig
    processor: MMProcessor
    ctx: zmq.Context[Any]
    frontend: PullSocket[FrontendInbound]
    to_sched: PushSocket[SchedulerInbound]
    tok: PullSocket[TokenizerInbound]
    procs: list[BaseProcess]
    stats: list[SchedulerStats] = field(default_factory=list)
    names: itertools.count[int] = field(default_factory=itertools.count)

    # ---- the tokenizer's part ---------------------------------------------------------------------
    def request(
        self,
        rid: str,
        messages: list[dict[str, Any]],
        sampling: SamplingParams = GREEDY,
        reuse: dict[bytes, str] | None = None,
    ) -> TokenizedRequest:
        """Process images, write each to its own segment (or hard-link a live one), build the prompt."""
        processed = [self.processor.process_image(img) for img in images_in(messages)]
        prompt = self.processor.build(self.processor.render(messages), processed)
        refs: dict[bytes, ShmRef] = {}
        for image in processed:
            name = segment_name(self.config.launch_id, f"{image.hash.hex()}-{next(self.names)}")
            pixels = image.pixel_values
            if reuse and image.hash in reuse and link_segment(reuse[image.hash], name):
                refs[image.hash] = shm_ref(name, pixels)
            else:
                seg, refs[image.hash] = ShmSegment.create_from_tensor(name, pixels)
                seg.close()
        items = [MMItem(s.hash, s.offset, s.length, s.grid, refs[s.hash]) for s in prompt.spans]
        names = [ref.name for ref in refs.values()]
        return TokenizedRequest(
            rid,
            prompt.input_ids,
            prompt.mrope_delta,
            items,
            sampling,
            names,
            sum(ref.nbytes for ref in refs.values()),
        )

    # ---- the frontend's part ----------------------------------------------------------------------
    def recv(self, timeout_s: float = TIMEOUT_S) -> FrontendInbound:
        msg = self.frontend.recv(int(timeout_s * 1000))
        assert msg is not None, "nothing from the scheduler in time"
        if isinstance(msg, SchedulerStats):
            self.stats.append(msg)
        return msg

    def collect(self, rids: set[str]) -> tuple[dict[str, list[RequestOutput]], dict[str, RequestFailed]]:
        """Outputs and failures until every rid in ``rids`` finished or failed."""
        outputs: dict[str, list[RequestOutput]] = {}
        failed: dict[str, RequestFailed] = {}
        done: set[str] = set()
        deadline = time.monotonic() + TIMEOUT_S
        while not rids <= done:
            msg = self.recv(deadline - time.monotonic())
            if isinstance(msg, OutputBatch):
                for out in msg.outputs:
                    assert out.rid not in done, f"output for {out.rid} after it finished"
                    outputs.setdefault(out.rid, []).append(out)
                    if out.finish_reason is not None:
                        done.add(out.rid)
            elif isinstance(msg, RequestFailed):
                failed[msg.rid] = msg
                done.add(msg.rid)
        return outputs, failed


def spawn(target: Callable[..., None], *args: object) -> BaseProcess:
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def start_stack(
    model_dir: Path, processor: MMProcessor, log_level: str = "warning", async_scheduling: bool = True,
    encoder_workers: int = 0,
) -> Stack:
    engine = EngineConfig(model=str(model_dir), max_model_len=4096, num_kv_blocks=256)
    budget = SHM_BUDGET
    # No retention here: these tests watch each request's names go away (retention: test_shm_ledger).
    config = ServerConfig(
        engine, new_launch_id(), "demo", tokenizer_workers=1, shm_budget_bytes=budget, log_level=log_level,
        shm_retain_fraction=0.0, async_scheduling=async_scheduling, encoder_workers=encoder_workers,
    )
    ctx = new_context()
    lid = config.launch_id
    frontend = PullSocket[FrontendInbound](ctx, ipc_address(lid, "frontend"), FrontendInbound, bind=True)
    tok = PullSocket[TokenizerInbound](ctx, ipc_address(lid, "tok0"), TokenizerInbound, bind=True)
    to_sched = PushSocket[SchedulerInbound](ctx, ipc_address(lid, "sched"), SchedulerInbound, bind=False)
    procs = [spawn(run_model_worker, config, 0), *(spawn(run_encoder_worker, config, i) for i in range(encoder_workers)),
             spawn(run_scheduler, config)]
    stack = Stack(config, processor, ctx, frontend, to_sched, tok, procs)
    msg = stack.recv()
    assert isinstance(msg, ProcessReady) and msg.role == "scheduler" and msg.pid == procs[-1].pid
    return stack


def stop_stack(stack: Stack) -> None:
    """Shutdown to the scheduler: both children must exit 0 and leave no segment of the launch."""
    try:
        stack.to_sched.send(Shutdown("test over"))
        for proc in stack.procs:
            proc.join(timeout=60)
        codes = [proc.exitcode for proc in stack.procs]
        assert codes == [0] * len(codes), f"exit codes (model, encoders, scheduler): {codes}"
        assert list_segments(stack.config.launch_id) == []
    finally:
        for proc in stack.procs:
            if proc.is_alive():
                proc.kill()
        sweep(stack.config.launch_id)
        for sock in (stack.frontend, stack.tok, stack.to_sched):
            sock.close()
        stack.ctx.term()
        cleanup_launch_dir(stack.config.launch_id)
