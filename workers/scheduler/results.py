"""Step results of the scheduler: a model rank's ``StepResult`` ends the oldest step in flight; its sampled tokens
go through the core (finishes, stop strings), each choice's text stream and tool-call parser, and leave as one
``OutputBatch`` to the frontend, a choice's first output carrying its prompt's log probabilities (packed). A
``WorkerFailed`` fails the requests of the step it names with a 500; the others go on.
"""

from __future__ import annotations

import time

from ipc.outputs import OutputBatch, RequestOutput
from ipc.steps import StepPlan, StepResult, WorkerFailed
from workers.common.reasoning import split_text
from workers.scheduler.intake import Intake


class StepResults(Intake):
    """Step results out, as outputs."""

    def _end_step(self, step_id: int) -> StepPlan | None:
        if not self.in_flight or self.in_flight[0].step_id != step_id:
            waiting_for = self.in_flight[0].step_id if self.in_flight else None
            self.log.warning("ignoring a report for step %d (in flight: %s)", step_id, waiting_for)
            return None
        self.steps += 1
        plan = self.in_flight.popleft()
        # The step is over: the landing segments it consumed (imports the cache admitted) go. A transient import's
        # stays landed for the image's next chunk (core/remote_encodes.py).
        self.unlink([imp.embeddings.name for imp in plan.mm_import if not imp.transient])
        return plan

    def _on_result(self, result: StepResult) -> None:
        started = time.monotonic()
        if self._end_step(result.step_id) is None:
            return
        self.images_encoded += result.images_encoded
        self.vit_batches += result.vit_calls
        outputs: list[RequestOutput] = []
        self.prompt_logprobs.collect(result.prompt_logprobs)
        for update in self.core.update(result):
            stream = self.streams.get(update.rid)
            if stream is None:
                continue
            token = [] if update.token_id is None else [update.token_id]  # none: max_tokens 0, the prompt alone
            self.generated_tokens += len(token)
            # Reasoning split off first (when a parser is on): tool calls are the content's.
            split = self.reasoning.get(update.rid)
            reasoning, text, reason = split_text(stream, split, update.token_id, update.finish_reason)
            stopped_by = stream.stop_reason(update.token_id, reason)
            if reason is not None:
                if update.finish_reason is None:  # a stop string matched: the core did not know
                    self.core.finish(update.rid, "stop")
                del self.streams[update.rid]
                self.reasoning.pop(update.rid, None)
            reasoning_tokens = None if split is None else split.tokens
            calls = None
            if (tools := self.tool_outputs.get(update.rid)) is not None:  # <tool_call> blocks -> tool_calls
                text, deltas, reason = tools.step(text, reason)
                calls = deltas or None
                if reason is not None:
                    del self.tool_outputs[update.rid]
            usage = (stream.prompt_tokens, stream.completion_tokens)
            lps = [self.logprobs.render(t, update.logprobs) for t in token] if update.logprobs is not None else None
            top_ids = list(update.logprobs.top_ids) if update.logprobs is not None and token else None
            outputs.append(
                RequestOutput(
                    update.request_id, text, token, reason, *usage, lps, update.index, update.cached_tokens,
                    calls, self.prompt_logprobs.take(update.rid), reasoning, reasoning_tokens, top_ids, stopped_by,
                )
            )
        self._flush_unlinks()
        if outputs:
            # When a request finishes, stats go first: the frontend answers it with stats that include it.
            self.send_stats(force=any(o.finish_reason for o in outputs))
            self.frontend.send(OutputBatch(outputs))
        self.trace.event("result", step=result.step_id, start=started, outputs=len(outputs))

    def _on_worker_failed(self, msg: WorkerFailed) -> None:
        self.log.error("model rank %d failed step %d: %s", msg.rank, msg.step_id, msg.message)
        plan = self._end_step(msg.step_id)
        if plan is None:
            return
        for rid in self.core.fail_step(plan.step_id):
            if self._drop_streams(rid):
                self._fail(rid, 500, f"the model failed on this request: {msg.message}")
        self._flush_unlinks()
