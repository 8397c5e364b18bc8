"""A render (workers/tokenizer/render.py) through a tokenizer worker, in-process: it is admitted like its generation
but writes no segment, so shared-memory pressure that refuses the generation (503) does not refuse the render, and
neither the request nor its images are counted as served."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from ipc.control import RequestFailed
from ipc.requests import GenerateRequest
from ipc.shm import list_segments
from tests.workers.tokenizer.harness import chat_body, png, server_config
from workers.tokenizer.render import as_generation, render_admitted
from workers.tokenizer.worker import TokenizerWorker


def test_a_render_is_answered_under_shm_pressure_and_not_counted(demo_model_dir: Path, launch_id: str) -> None:
    worker = TokenizerWorker(server_config(demo_model_dir, launch_id), 0, logging.getLogger("test"))
    try:
        body = chat_body([png(64, 64, seed=11)])
        worker.shm_bytes = worker.shm_budget  # full: a generation with images is refused
        refused = worker.handle(GenerateRequest("g1", body, time.time()))
        assert isinstance(refused, RequestFailed) and (refused.status, refused.code) == (503, "shm_budget_exceeded")
        requests, images = worker.requests, worker.images
        gen = as_generation(GenerateRequest("r1", body, time.time(), endpoint="chat_render"))
        rendered = json.loads(render_admitted(worker, gen, worker.admit(gen, render=True)))
        token = worker.processor.info.image_token_id
        [span] = rendered["features"]["mm_placeholders"]["image"]
        assert rendered["token_ids"][span["offset"] : span["offset"] + span["length"]] == [token] * span["length"]
        assert (worker.requests, worker.images) == (requests, images)
        assert list_segments(launch_id) == []
    finally:
        worker.close()
