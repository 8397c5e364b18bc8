"""A model worker's side of encoding ahead (``--encode-ahead-tokens``, core/encode_ahead.py): the last
``StepPlan.encode_ahead`` jobs of a step are images a later step reads, so they run on a second CUDA stream after the
step's forward has been queued, and the ViT overlaps the language model on the GPU instead of delaying it. The
steps' stream has the device's highest priority and the side stream its lowest: the SMs take a decode kernel's blocks
as soon as the ViT's running blocks retire, instead of after the ViT kernel's queued ones.

Two events keep the streams apart:
* ``ready``, recorded on the step's stream before its forward: the store rows an ahead encode writes may have been
  freed by this step's evictions, and the last reads of those rows were queued before that point (this step's
  forward reads none of them: the index pins what a step reads). The rows of the step's transient entries, which its
  forward does read, are freed only after the ahead encodes have taken theirs (ModelRunner.launch);
* ``done``, recorded on the side stream after the ahead encodes: a later step's stream waits for it before it does
  anything, if that step splices, evicts or spills an entry still being encoded (``store_reads``). Steps that touch
  none of them (decodes, chunks of other images) go on beside the ViT, so a whole image's encode is not a wait in
  front of the next decode step. Nothing else a step does meets the rows being written: its own encodes, reloads and
  imports take rows off the free list, and the entries being written are not on it.

On the CPU there is one stream: the jobs simply run after the forward. With TP the ViT's all-gather would be a
collective on a second stream beside the LM's, which NCCL does not order across ranks, so serve_cli refuses the
combination.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ipc.steps import EncodeJob, StepPlan
from workers.engine.runner.encoder import JobEncoder
from workers.engine.runner.step_inputs import WorkerSeq


class AheadEncodes:
    def __init__(self, encoder: JobEncoder, device: torch.device, tokens: int = 0, tp_size: int = 1) -> None:
        """``tokens``: --encode-ahead-tokens (0: the scheduler plans no ahead encode). With it on CUDA the worker's
        steps run on a stream of the device's highest priority and the ahead encodes on one of the lowest, so that
        when both have work queued the SMs take a decode step's blocks before the rest of a ViT GEMM's."""
        if tokens and tp_size > 1:
            raise ValueError("encode_ahead_tokens needs tp 1: the ViT's all-gather cannot run on a second stream")
        self.encoder = encoder
        self.device = device
        self.stream = torch.cuda.Stream(device, priority=0) if device.type == "cuda" else None  # 0: the lowest
        if tokens and self.stream is not None:
            # Nothing orders a new stream after the default one: what the start-up queued there finishes first.
            torch.cuda.synchronize(device)
            torch.cuda.set_stream(torch.cuda.Stream(device, priority=-100))  # out of range: the device's highest
        self._ready: torch.cuda.Event | None = None
        self._done: torch.cuda.Event | None = None
        self.pending: set[bytes] = set()  # keys of the entries the side stream may still be writing
        self.images = 0  # images encoded ahead so far
        self.waits = 0  # steps that waited for the side stream

    def wait(self, reads: Callable[[], set[bytes]]) -> None:
        """At the start of a step, given the store keys it reads or frees (``store_reads``, asked only while an
        ahead encode may be running): waits for the side stream if the step needs any entry it is writing."""
        if self._done is None:
            return
        if self._done.query():  # finished already: nothing to order
            self._done, self.pending = None, set()
            return
        if self.needs_wait(reads()):
            torch.cuda.current_stream(self.device).wait_event(self._done)
            self._done, self.pending = None, set()
            self.waits += 1

    def needs_wait(self, reads: set[bytes]) -> bool:
        return not self.pending.isdisjoint(reads)

    def mark(self, jobs: list[EncodeJob]) -> None:
        """Right before the step's forward is queued (the point past which no queued work reads a freed row)."""
        if jobs and self.stream is not None:
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(self.device))

    def run(self, jobs: list[EncodeJob]) -> int:
        """Encode ``jobs`` into the store beside the queued forward; the number of images."""
        if not jobs:
            return 0
        if self.stream is None:
            images = self.encoder.run(jobs)
        else:
            if self._ready is not None:
                self.stream.wait_event(self._ready)
                self._ready = None
            with torch.cuda.stream(self.stream):
                images = self.encoder.run(jobs)
            self._done = torch.cuda.Event()  # recorded after every earlier ahead job too: one stream, in order
            self._done.record(self.stream)
            self.pending.update(job.key for job in jobs)
        self.images += images
        return images


def store_reads(plan: StepPlan, seqs: Mapping[str, WorkerSeq]) -> set[bytes]:
    """The embedding-store keys ``plan`` reads or frees: the entries its chunks splice (an image's hash, or in the
    per-request mode the request's key), those it evicts or spills, and those it encodes (a put replaces an entry)."""
    keys = set(plan.evict) | set(plan.mm_spill) | {job.key for job in plan.encode}
    new = {s.rid: s for s in plan.new_seqs}
    for chunk in plan.chunks:
        seq = seqs.get(chunk.rid) or new.get(chunk.rid)
        if seq is None:
            continue
        end = chunk.start + chunk.length
        keys.update(seq.mm_key or item.hash for item in seq.items
                    if item.offset < end and item.offset + item.length > chunk.start)
    return keys
