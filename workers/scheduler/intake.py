"""Request intake of the scheduler: a ``TokenizedRequest`` becomes sequences of the core (or an error to the
frontend: shm budget, an empty or too long prompt, a duplicate rid) with a text stream per choice and, when it
asked for them, its prompt log probabilities expected; an abort drops a request's streams and sequences, or, for
a request not seen yet (it travels another pipe), is remembered so the request is dropped on arrival.
"""

from __future__ import annotations

from ipc.prompts import TokenizedRequest
from workers.common.detokenizer import TextStream
from workers.common.reasoning import make_split
from workers.common.tool_output import ToolOutput
from workers.engine.core.scheduler import RequestRejected
from workers.engine.core.sequence import child_rid
from workers.scheduler.base import SchedulerBase, unlink_all

_RECENT_ABORTS = 65536  # aborts of rids not (yet) known; old entries fall out first


class Intake(SchedulerBase):
    """Requests and aborts in."""

    def _on_request(self, req: TokenizedRequest) -> None:
        if not self.core.has_work() and not self.in_flight:
            self.gpu_peak = 0
            self.gpu_idle = max((w.gpu_allocated_bytes for w in self.worker_stats.values()), default=0)
        images = {it.hash: it.pixels.nbytes for it in req.items if it.pixels is not None}
        name_of = {it.hash: it.pixels.name for it in req.items if it.pixels is not None}
        # Images still being written: their names join the holding once published (MediaReady).
        pending = {h: name_of.pop(h) for h in req.pending if h in name_of}
        if req.rid in self.aborted:
            del self.aborted[req.rid]
            self._refuse(req, pending)
            return
        extra = self.ledger.extra_bytes(images)
        self.unlink(self.ledger.make_room(extra))
        if extra and self.ledger.used_bytes + extra > self.ledger.budget_bytes:
            self._refuse(req, pending, 503, "shared memory budget exceeded, retry later", "shm_budget_exceeded")
            return
        try:
            self.core.add(req.rid, req.input_ids, req.mrope_delta, req.items, req.sampling, req.more_prompts, pending)
        except ValueError as exc:
            # RequestRejected: an empty prompt, or one too long for the context or the KV cache; plain
            # ValueError: a duplicate rid (these names are this message's own links, safe to unlink).
            too_long = isinstance(exc, RequestRejected) and bool(req.input_ids)
            self._refuse(req, pending, 400, str(exc), "context_length_exceeded" if too_long else None)
            return
        published = [n for n in req.shm_names if n not in pending.values()]
        self.ledger.hold(req.rid, published, images, name_of, pending)
        prompts = [req.input_ids, *req.more_prompts]  # a batch of prompts: choice p answers prompt p
        self.prompt_tokens += (total := sum(len(p) for p in prompts))
        self.prompt_logprobs.expect(req.rid, prompts, req.sampling)
        self.trace.event("arrive", rid=req.rid, tokens=len(req.input_ids), images=len(req.items))
        for index in range(max(req.sampling.n, len(prompts))):  # one per choice: its own text and stop strings
            keep = self.gemma_tool_ids if req.tool_parser == "gemma4" else frozenset()  # its tags stay text
            self.streams[child_rid(req.rid, index)] = TextStream(self.tokenizer, req.sampling.stop, total, keep=keep,
                                                                  stop_token_ids=req.sampling.stop_token_ids)
            if req.tool_parser:
                self.tool_outputs[child_rid(req.rid, index)] = ToolOutput(req.tool_parser, req.tool_arg_types)
            if req.reasoning_parser:
                split = make_split(req.reasoning_parser, req.reasoning_inside, self.reasoning_marker_ids)
                self.reasoning[child_rid(req.rid, index)] = split

    def _refuse(
        self, req: TokenizedRequest, pending: dict[bytes, str], status: int = 0, message: str = "", code: str | None = None
    ) -> None:
        """Drop a request on arrival (failing it with ``status`` unless 0): its names go, and so do those of images
        still being written, once they are."""
        unlink_all(req.shm_names)
        self.ledger.orphan(req.rid, pending)
        if status:
            self._fail(req.rid, status, message, code)

    def _on_abort(self, rid: str) -> None:
        self._drop_streams(rid)
        if not self.core.abort(rid):
            # Unknown: its TokenizedRequest may still be on the way (another pipe); drop it on arrival.
            self.aborted[rid] = None
            if len(self.aborted) > _RECENT_ABORTS:
                self.aborted.popitem(last=False)

    def _drop_streams(self, rid: str) -> bool:
        """Forget the text streams of request ``rid`` (all its choices); whether it had any."""
        found = self.streams.pop(rid, None) is not None
        self.prompt_logprobs.drop(rid)
        self.tool_outputs.pop(rid, None)
        self.reasoning.pop(rid, None)
        index = 1
        while self.streams.pop(child_rid(rid, index), None) is not None:
            self.tool_outputs.pop(child_rid(rid, index), None)
            self.reasoning.pop(child_rid(rid, index), None)
            index, found = index + 1, True
        return found
