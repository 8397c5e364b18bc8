"""The scheduler's record of images a tokenizer is still writing for requests the scheduler already holds.

With overlap of preprocessing and prefill (workers/tokenizer_service.py) a request arrives with the names
of some images fixed but not yet written; MediaReady or MediaFailed follows. Until then the names are not
the ledger's: a request that ends early (aborted, refused) keeps them here as an orphan, so a name the
tokenizer publishes afterwards is unlinked when its MediaReady arrives rather than left in /dev/shm.
"""

from __future__ import annotations

from collections import OrderedDict

# Orphans remembered: a tokenizer that died mid-write never reports, and its names were unlinked at once.
_ORPHANS_KEPT = 1024


class PendingMedia:
    def __init__(self) -> None:
        self._live: dict[str, dict[bytes, str]] = {}  # rid -> image hash -> name, for requests being served
        self._orphans: OrderedDict[str, dict[bytes, str]] = OrderedDict()  # ended requests, images still coming

    def __len__(self) -> int:
        return sum(len(names) for names in self._live.values())

    def hold(self, rid: str, names: dict[bytes, str]) -> None:
        if names:
            self._live[rid] = dict(names)

    def ready(self, rid: str, hashes: list[bytes]) -> tuple[dict[bytes, str], list[str]]:
        """Images of ``rid`` were published: (their names, for a request being served; names to unlink, for an
        ended one)."""
        live = self._live.get(rid)
        if live is not None:
            published = {h: live.pop(h) for h in hashes if h in live}
            if not live:
                del self._live[rid]
            return published, []
        orphan = self._orphans.get(rid, {})
        gone = [orphan.pop(h) for h in hashes if h in orphan]
        if not orphan:
            self._orphans.pop(rid, None)
        return {}, gone

    def failed(self, rid: str) -> list[str]:
        """The tokenizer gave ``rid`` up (its writes are stopped or stopping; it unlinks what it never reported):
        the names still recorded, to unlink too (a report whose send was cancelled leaves its name here)."""
        names = [*self._live.pop(rid, {}).values(), *self._orphans.pop(rid, {}).values()]
        return names

    def ended(self, rid: str) -> list[str]:
        """``rid`` ended with images still coming: their names, to unlink now (a dead tokenizer never reports);
        they are kept as an orphan, to be unlinked again once published."""
        names = self._live.pop(rid, None)
        if not names:
            return []
        self._orphans[rid] = names
        while len(self._orphans) > _ORPHANS_KEPT:
            self._orphans.popitem(last=False)
        return list(names.values())
