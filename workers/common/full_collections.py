"""Full garbage collections off the serving path.

CPython collects its oldest generation on its own once enough objects have survived the young ones, wherever the
interpreter happens to be: in a model worker that is between two launches of a loaded server. Such a collection
walks every tracked object the start-up freeze (proc.freeze_heap) did not take out of its reach, and on an H200 the
model worker's took 50-90 ms each under load. Under (b)'s 64 streams one stalled step is 64 inter-token gaps, so two
of them are 1.6% of a run's gaps: the p99's share.

``FullCollections`` takes the oldest generation off the interpreter's schedule (its threshold raised past reach; the
young generations keep theirs) and collects it at moments that stall nothing:
- when the process has been idle ``idle_s`` after some work;
- under load without an idle moment for ``overdue_s``: right after a launch, so the GPU has work queued while the
  host collects. The garbage a busy process leaves in cycles is then bounded by that much serving.
``GLIMPSE_GC_OFF_PATH=0`` leaves the interpreter's own schedule in place."""

from __future__ import annotations

import gc
import os

from workers.common.proc import GcWatch

GC_IDLE_S = 0.5  # idle this long after work: a full collection stalls nothing
GC_OVERDUE_S = 60.0  # busy this long without an idle moment: collect anyway, between launches
_OUT_OF_REACH = 1 << 30  # the oldest generation's threshold: young collections never add up to it


def off_path_enabled() -> bool:
    return os.environ.get("GLIMPSE_GC_OFF_PATH", "1") != "0"


class FullCollections:
    """When this process collects its oldest generation (see the module docstring). ``worked`` after each unit of
    work, ``poll`` where the process waits or has just handed the GPU its next step."""

    def __init__(
        self,
        watch: GcWatch | None = None,
        idle_s: float = GC_IDLE_S,
        overdue_s: float = GC_OVERDUE_S,
        enabled: bool | None = None,
    ) -> None:
        self.enabled = off_path_enabled() if enabled is None else enabled
        self.watch = watch
        self.idle_s, self.overdue_s = idle_s, overdue_s
        self.pending = False  # work since the last full collection
        self.pending_since = 0.0  # when that work began: a burst after a long idle time is not overdue at once
        self.idle_since = 0.0
        self.idle_runs = self.overdue_runs = 0
        self._thresholds = gc.get_threshold()
        if self.enabled:
            young, middle, _ = self._thresholds
            gc.set_threshold(young, middle, _OUT_OF_REACH)

    def close(self) -> None:
        """Give the interpreter its own schedule back (the process serves no more: a test's, or one shutting down)."""
        if self.enabled:
            gc.set_threshold(*self._thresholds)
            self.enabled = self.pending = False

    def worked(self, now: float, idle: bool) -> None:
        """A unit of work ended at ``now``; ``idle``: nothing is left in flight."""
        if not self.enabled:
            return
        if not self.pending:
            self.pending, self.pending_since = True, now
        if idle:
            self.idle_since = now

    def poll(self, now: float, idle: bool) -> bool:
        """Collect if the process has been idle long enough, or busy too long without an idle moment. True: it did."""
        if not self.pending:
            return False
        if idle and now - self.idle_since >= self.idle_s:
            self.idle_runs += 1
            self._collect(off_path=True)
            return True
        if not idle and now - self.pending_since >= self.overdue_s:
            self.overdue_runs += 1
            self._collect(off_path=False)
            return True
        return False

    def _collect(self, off_path: bool) -> None:
        if self.watch is not None:
            with self.watch.off_path(off_path):
                gc.collect()
        else:
            gc.collect()
        self.pending = False
