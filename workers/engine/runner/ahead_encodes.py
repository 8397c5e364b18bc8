"""A model worker's side of encoding ahead (``--encode-ahead-tokens``, core/encode_ahead.py): the last
``StepPlan.encode_ahead`` jobs of a step are images a later step reads, so they run on a second CUDA stream after the
step's forward has been queued, and the ViT overlaps the language model on the GPU instead of delaying it.

Two events keep the streams apart:
* ``ready``, recorded on the step's stream before its forward: the store rows an ahead encode writes may have been
  freed by this step's evictions, and the last reads of those rows were queued before that point (this step's
  forward reads none of them: the index pins what a step reads). The rows of the step's transient entries, which its
  forward does read, are freed only after the ahead encodes have taken theirs (ModelRunner.launch);
* ``done``, recorded on the side stream after the ahead encodes: the next step's stream waits for it before it does
  anything (spills and reloads read the store, and its forward reads the new entries).

On the CPU there is one stream: the jobs simply run after the forward. With TP the ViT's all-gather would be a
collective on a second stream beside the LM's, which NCCL does not order across ranks, so serve_cli refuses the
combination.
"""

from __future__ import annotations

import torch

from ipc.steps import EncodeJob
from workers.engine.runner.encoder import JobEncoder


class AheadEncodes:
    def __init__(self, encoder: JobEncoder, device: torch.device) -> None:
        self.encoder = encoder
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: torch.cuda.Event | None = None
        self._done: torch.cuda.Event | None = None
        self.images = 0  # images encoded ahead so far

    def wait(self) -> None:
        """At the start of a step: everything the last ahead encodes wrote is in place before this step's work."""
        if self._done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done)
            self._done = None

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
            self._done = torch.cuda.Event()
            self._done.record(self.stream)
        self.images += images
        return images
