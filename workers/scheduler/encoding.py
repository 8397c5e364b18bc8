"""Encoder workers' answers in the scheduler (``--encoder-workers``): the requests the core queued go out to the
pool, a landed entry is handed to the core (the next plans import it), and a failed encode fails the requests waiting
on it: with the encoder's status (400 when the request's pixels are at fault), the others go on.
"""

from __future__ import annotations

from ipc.encode import EncodeDone, EncodeFailed
from ipc.landing import PoolLanding
from workers.scheduler.results import StepResults


class EncodeAnswers(StepResults):
    """Encode requests out, encoder answers in."""

    def _dispatch_encodes(self) -> None:
        """Send what the core asked encoder workers for since the last call (admissions, pixels that landed)."""
        if self.core.remote is not None and (jobs := self.core.remote.drain()):
            self.encoding.send(jobs)

    def _on_encode_done(self, msg: EncodeDone) -> None:
        self.encoding.answered(msg.key)
        ref = msg.embeddings
        if isinstance(ref, PoolLanding):  # the encoder's pool (CUDA or NIXL): released, not unlinked, and no shm budget
            self.encoding.landed_in_pool(ref.name, ref.encoder)
        else:
            # Its bytes count against --shm-budget-mb until it is unlinked: accepted even past the budget (the encode
            # is done and a request waits for it), but new image requests get 503 until the shared memory drains.
            self.ledger.land(ref.name, ref.nbytes)
        if self.core.remote is None:
            self.unlink([msg.embeddings.name])
            return
        wrong = self.core.remote.done(msg.key, msg.embeddings, msg.rows)
        if wrong:
            self.log.error("encoder %d returned %d rows for %s, not what the prompt holds", msg.encoder, msg.rows,
                           msg.key.hex()[:16])
            self._fail_waiters(wrong, 500, f"an encoder worker returned {msg.rows} embedding rows for an image of "
                               "another size")
        self._flush_unlinks()  # its pixels are no longer busy

    def _on_encode_failed(self, msg: EncodeFailed) -> None:
        self.encoding.answered(msg.key)
        if self.core.remote is not None:
            self._fail_waiters(self.core.remote.failed(msg.key), msg.status, msg.error)
        self._flush_unlinks()

    def _fail_waiters(self, seq_ids: list[str], status: int, message: str) -> None:
        """Fail the requests of sequences ``seq_ids`` (whole requests: every choice) with ``status``."""
        rids = dict.fromkeys(self.core.seqs[s].request_id for s in seq_ids if s in self.core.seqs)
        for rid in rids:
            if self._drop_streams(rid):
                self._fail(rid, status, message)
            self.core.abort(rid)
