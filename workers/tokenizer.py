"""Tokenizer worker process: HTTP body in, ready prompt with pixels in shared memory out.

All CPU work of a request happens here, never on the frontend's event loop: JSON parsing and
validation, base64, downloads, decoding, hashing, image processing, the chat template and
tokenization. Per request the worker answers the frontend with `RequestAccepted` and hands the
scheduler a `TokenizedRequest`, or answers `RequestFailed` and sends the scheduler nothing.

Images become shared-memory segments in workers/image_prep.py: reused by the hash of their bytes
when a live segment exists, else decoded, processed and written, the fresh images of one request
concurrently on a thread pool.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

import jinja2
import torch

from ipc.channels import PullSocket, PushSocket, new_context
from ipc.launch import ipc_address
from ipc.messages import (
    FrontendInbound,
    GenerateRequest,
    MMItem,
    ProcessReady,
    RequestAccepted,
    RequestFailed,
    SchedulerInbound,
    SchedulerStats,
    Shutdown,
    TokenizedRequest,
    TokenizerInbound,
    TokenizerStats,
)
from workers.config import ServerConfig
from workers.chat_request import BadRequest, image_refs, parse_request, template_messages, to_sampling_params
from workers.engine.processor import ImageInfo, MMProcessor
from workers.image_prep import ImagePrep, core_share, overloaded
from workers.media import MediaFetcher, MediaLimits
from workers.proc import setup_child

STATS_INTERVAL_S = 0.5


class TokenizerWorker:
    """The request handling of one tokenizer, independent of sockets."""

    def __init__(self, config: ServerConfig, index: int, log: logging.Logger) -> None:
        if config.max_model_len is None:
            raise ValueError("engine.max_model_len must be resolved by the launcher before children start")
        self.config, self.index, self.log = config, index, log
        self.max_model_len = config.max_model_len
        self.processor = MMProcessor(config.engine.model, config.engine.model_spec())
        self.prep = ImagePrep(config, index, self.processor)
        self.fetcher = MediaFetcher(MediaLimits.from_config(config))
        # Back-pressure: the scheduler's last word on shm in flight, plus what we sent since.
        self.shm_bytes = 0
        self.shm_budget = config.shm_budget_bytes
        self.requests = self.images = 0

    @property
    def images_reused(self) -> int:
        return self.prep.images_reused

    def close(self) -> None:
        self.prep.close()
        self.fetcher.close()

    def on_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.shm_bytes = stats.shm_bytes
        self.shm_budget = stats.shm_budget_bytes

    def stats(self, queue_depth: int) -> TokenizerStats:
        return TokenizerStats(self.index, queue_depth, self.requests, self.images, self.images_reused)

    # ---- one request ----------------------------------------------------------------------------

    def handle(self, req: GenerateRequest) -> tuple[RequestAccepted, TokenizedRequest] | RequestFailed:
        """Prepare one request. Names created here are unlinked again on any failure, since the
        scheduler (the owner of unlinking) only learns of them through the TokenizedRequest."""
        self.requests += 1
        names: list[str] = []
        try:
            return self._prepare(req, names)
        except BadRequest as exc:
            self.prep.release(names)
            # Client mistakes are the frontend's access log's business; overload is the operator's.
            level = logging.WARNING if exc.status >= 500 else logging.DEBUG
            self.log.log(level, "request %s refused: %d %s", req.rid, exc.status, exc.message)
            return exc.to_failed(req.rid)
        except Exception as exc:
            self.prep.release(names)
            self.log.exception("request %s failed", req.rid)
            return RequestFailed(req.rid, 500, f"Internal error preparing the request: {exc}", "server_error")

    def _prepare(self, req: GenerateRequest, names: list[str]) -> tuple[RequestAccepted, TokenizedRequest]:
        chat = parse_request(req.body)
        if chat.model != self.config.served_model_name:
            message = f"The model `{chat.model}` does not exist."
            raise BadRequest(message, status=404, param="model", code="model_not_found")
        refs = image_refs(chat)
        if len(refs) > (limit := self.config.max_images_per_request):
            message = f"The request has {len(refs)} images; this server accepts at most {limit}."
            raise BadRequest(message, param="messages", code="too_many_images")
        if refs and self.shm_bytes >= self.shm_budget:
            raise overloaded()  # refuse before spending CPU on a request we could not hand on
        self.images += len(refs)
        raws = self.fetcher.load_many([(r.url, r.param) for r in refs])
        order = self.prep.plan(raws, [r.param for r in refs])
        metas = [ImageInfo(im.hash, im.grid, self.processor.tokens_for_grid(im.grid)) for im in order]
        try:
            prompt = self.processor.build(self.processor.render(template_messages(chat)), metas)
        except (ValueError, jinja2.TemplateError) as exc:  # e.g. image-pad tokens typed into the text
            raise BadRequest(f"The messages cannot be made into a prompt: {exc}", param="messages") from None
        sampling = to_sampling_params(chat, len(prompt.input_ids), self.max_model_len)
        # Segments only now, after every check that could refuse the request.
        distinct = list({im.hash: im for im in order}.values())
        new_bytes = self.prep.materialize(distinct, names, self.shm_bytes, self.shm_budget)
        self.shm_bytes += new_bytes
        items = [
            MMItem(s.hash, s.offset, s.length, s.grid, im.ref)
            for s, im in zip(prompt.spans, order, strict=True)
        ]
        n = len(prompt.input_ids)
        accepted = RequestAccepted(req.rid, chat.stream, chat.include_usage, chat.model, n, self.index)
        tokenized = TokenizedRequest(
            req.rid, prompt.input_ids, prompt.mrope_delta, items, sampling, names, new_bytes
        )
        return accepted, tokenized


# ---- the process --------------------------------------------------------------------------------


def run_tokenizer(config: ServerConfig, index: int) -> None:
    """Entry point of tokenizer process `index`; returns (exit 0) on Shutdown or when orphaned."""
    log = setup_child(f"glimpse.tokenizer[{index}]", config.log_level)
    parent = os.getppid()
    # Several tokenizers share the cores with the scheduler; one torch pool per core each would oversubscribe.
    torch.set_num_threads(core_share(config))
    worker = TokenizerWorker(config, index, log)
    ctx = new_context()
    lid = config.launch_id
    inbound = PullSocket[TokenizerInbound](ctx, ipc_address(lid, f"tok{index}"), TokenizerInbound, bind=True)
    frontend = PushSocket[FrontendInbound](ctx, ipc_address(lid, "frontend"), FrontendInbound, bind=False)
    sched = PushSocket[SchedulerInbound](ctx, ipc_address(lid, "sched"), SchedulerInbound, bind=False)
    try:
        frontend.send(ProcessReady("tokenizer", index, os.getpid()))
        log.info("ready (pid %d, model %s)", os.getpid(), config.served_model_name)
        _serve(worker, inbound, frontend, sched, parent)
    finally:
        worker.close()
        inbound.close()
        # A short linger lets the last replies out without hanging on a frontend that is gone.
        frontend.close(linger_ms=500)
        sched.close(linger_ms=500)
        ctx.term()
    log.info("stopped")


def _serve(
    worker: TokenizerWorker,
    inbound: PullSocket[TokenizerInbound],
    frontend: PushSocket[FrontendInbound],
    sched: PushSocket[SchedulerInbound],
    parent: int,
) -> None:
    """Drain everything waiting into a local queue (so queue depth is known and scheduler stats and
    Shutdown are seen at once), then handle one request; repeat."""
    pending: deque[GenerateRequest] = deque()
    last_stats = 0.0
    while True:
        msg = inbound.recv(0 if pending else int(STATS_INTERVAL_S * 1000))
        while msg is not None:
            if isinstance(msg, GenerateRequest):
                pending.append(msg)
            elif isinstance(msg, SchedulerStats):
                worker.on_scheduler_stats(msg)
            elif isinstance(msg, Shutdown):
                worker.log.info(
                    "shutdown (%s); failing %d queued requests", msg.reason or "no reason", len(pending)
                )
                for req in pending:
                    frontend.send(RequestFailed(req.rid, 503, "The server is shutting down.", "server_error"))
                return
            msg = inbound.recv(0)
        if pending:
            req = pending.popleft()
            result = worker.handle(req)
            if isinstance(result, RequestFailed):
                frontend.send(result)
            else:
                # Accepted first: the frontend must know how to answer before outputs can arrive.
                frontend.send(result[0])
                sched.send(result[1])
        now = time.monotonic()
        if now - last_stats >= STATS_INTERVAL_S or not pending:
            frontend.send(worker.stats(len(pending)))
            last_stats = now
        if os.getppid() != parent:
            worker.log.warning("launcher is gone; exiting")
            return
