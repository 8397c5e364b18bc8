"""The scheduler's account of pixels in shared memory: who holds which image, how many bytes are in
flight, and which recently finished images stay alive for reuse.

Bytes are counted once per distinct image hash: every request holds its own *name* of an image, but
names of one image are hard links to the same pages. When the last request holding an image
finishes, one of its names is *retained* (LRU) instead of unlinked, so the next turn of a chat that
resends the image finds a live segment and the tokenizer skips decode, processing and the write.
Retained images give their bytes back first whenever a new request needs room, and never take more
than ``retain_fraction`` of the budget. A retained image nobody used for ``retain_idle_s`` is
unlinked too (`expire`), so an idle server gives its shared memory back.

With overlap of preprocessing and prefill a request arrives before some of its images are written: their
bytes count from the start, their names join the holding only once published (`publish`). A request that
ends first leaves those names as an orphan: unlinked at once (a tokenizer that died never reports), and
again when one is published after all, so nothing stays behind in /dev/shm.

With encoder workers (``--encoder-workers``) the budget also counts each *landing* segment (an image's embeddings,
written by an encoder) from the ``EncodeDone`` that hands it to the scheduler until the scheduler unlinks it, so the
budget bounds everything of the launch in /dev/shm. A landing segment is never refused (its encode is done and a
running request waits for it); while pixels and landing together are past the budget, new image requests are.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

# Ended requests whose images were still being written, remembered (oldest dropped first; their names were
# unlinked when they ended).
_ORPHANS_KEPT = 1024


@dataclass
class ShmLedger:
    budget_bytes: int
    retain_fraction: float = 0.5
    retain_idle_s: float = 0.0  # 0: retained images never expire by age
    _refs: Counter[bytes] = field(default_factory=Counter)  # hash -> live requests holding it
    _sizes: dict[bytes, int] = field(default_factory=dict)  # live hashes
    _held: dict[str, tuple[list[str], dict[bytes, int], dict[bytes, str]]] = field(default_factory=dict)
    _retained: OrderedDict[bytes, tuple[str, int]] = field(default_factory=OrderedDict)  # oldest first
    _last_used: dict[bytes, float] = field(default_factory=dict)  # retained hash -> when it was last held
    _pending: dict[str, dict[bytes, str]] = field(default_factory=dict)  # rid -> hash -> name still being written
    _orphans: OrderedDict[str, dict[bytes, str]] = field(default_factory=OrderedDict)  # ended, images still coming
    _landing: dict[str, int] = field(default_factory=dict)  # landing segment name -> bytes, until unlinked

    @property
    def used_bytes(self) -> int:
        """Bytes the budget counts: live and retained pixels, and landing segments."""
        live = sum(self._sizes.values())
        retained = sum(n for h, (_, n) in self._retained.items() if h not in self._sizes)
        return live + retained + self.landing_bytes

    @property
    def landing_bytes(self) -> int:
        return sum(self._landing.values())

    @property
    def landing_segments(self) -> int:
        return len(self._landing)

    def land(self, name: str, nbytes: int) -> None:
        """An encoder worker handed the scheduler its landing segment ``name`` of ``nbytes``: counted until unlinked."""
        self._landing[name] = nbytes

    def unlinked(self, names: list[str]) -> None:
        """``names`` are gone from /dev/shm: landing segments among them stop counting (pixel names are accounted
        by hash, through ``release``)."""
        if self._landing:
            for name in names:
                self._landing.pop(name, None)

    @property
    def retained_bytes(self) -> int:
        return sum(n for _, n in self._retained.values())

    @property
    def retained_segments(self) -> int:
        return len(self._retained)

    @property
    def segments(self) -> int:
        return sum(len(names) for names, _, _ in self._held.values()) + len(self._retained)

    def extra_bytes(self, images: dict[bytes, int]) -> int:
        """Bytes in flight would grow by this much if a request holding ``images`` were admitted."""
        return sum(n for h, n in images.items() if h not in self._sizes and h not in self._retained)

    def make_room(self, extra: int) -> list[str]:
        """Drop retained images (oldest first) until ``extra`` more bytes fit; returns names to unlink."""
        out: list[str] = []
        while self._retained and self.used_bytes + extra > self.budget_bytes:
            out.append(self._drop_oldest())
        return out

    def hold(
        self,
        rid: str,
        names: list[str],
        images: dict[bytes, int],
        name_of: dict[bytes, str],
        pending: dict[bytes, str] | None = None,
    ) -> None:
        """``rid`` holds ``images`` (hash -> bytes) under ``names`` (published ones; ``name_of`` by hash) and the
        ``pending`` ones (hash -> name) still being written."""
        self._held[rid] = (names, images, name_of)
        if pending:
            self._pending[rid] = dict(pending)
        self._refs.update(images.keys())
        self._sizes.update(images)
        for h in images:
            if h in self._retained:
                self._retained.move_to_end(h)  # used again: the last to be dropped

    def publish(self, rid: str, hashes: list[bytes]) -> tuple[list[bytes], list[str]]:
        """Pending images of ``rid`` were written: (the hashes now part of a held request's holding, the names to
        unlink where the request already ended)."""
        pending, held = self._pending.get(rid), self._held.get(rid)
        if pending is not None and held is not None:
            published = {h: pending.pop(h) for h in hashes if h in pending}
            held[0].extend(published.values())
            held[2].update(published)
            if not pending:
                del self._pending[rid]
            return list(published), []
        orphan = self._orphans.get(rid, {})
        gone = [orphan.pop(h) for h in hashes if h in orphan]
        if not orphan:
            self._orphans.pop(rid, None)
        return [], gone

    def pending_failed(self, rid: str) -> list[str]:
        """The tokenizer gave ``rid``'s pending images up (it unlinks those it never reported): the names still
        recorded, to unlink too (a report whose send was cancelled leaves its name here)."""
        return [*self._pending.pop(rid, {}).values(), *self._orphans.pop(rid, {}).values()]

    def orphan(self, rid: str, pending: dict[bytes, str]) -> list[str]:
        """``rid`` ended with images still being written: their names, to unlink now and once published."""
        if not pending:
            return []
        self._orphans[rid] = dict(pending)
        while len(self._orphans) > _ORPHANS_KEPT:
            self._orphans.popitem(last=False)
        return list(pending.values())

    def release(self, rid: str, now: float | None = None) -> list[str]:
        """Forget ``rid``'s holdings; returns the names to unlink (one name per newly idle image stays)."""
        now = time.monotonic() if now is None else now
        names, images, name_of = self._held.pop(rid, ([], {}, {}))
        orphaned = self.orphan(rid, self._pending.pop(rid, {}))
        keep: set[str] = set()
        self._refs.subtract(images.keys())
        for h, size in images.items():
            if self._refs[h] > 0:
                continue
            del self._refs[h], self._sizes[h]
            if h in self._retained:
                self._last_used[h] = now  # idle again from now
            elif h in name_of:
                self._retained[h] = (name_of[h], size)
                self._last_used[h] = now
                keep.add(name_of[h])
        out = [n for n in names if n not in keep] + orphaned
        limit = int(self.budget_bytes * self.retain_fraction)
        while self._retained and self.retained_bytes > limit:
            out.append(self._drop_oldest())
        return out

    def expire(self, now: float | None = None) -> list[str]:
        """Names of retained images idle (held by no request) for ``retain_idle_s``; they are forgotten."""
        if self.retain_idle_s <= 0:
            return []
        cutoff = (time.monotonic() if now is None else now) - self.retain_idle_s
        stale = [h for h in self._retained if h not in self._sizes and self._last_used.get(h, cutoff) <= cutoff]
        out = []
        for h in stale:
            name, _ = self._retained.pop(h)
            self._last_used.pop(h, None)
            out.append(name)
        return out

    def _drop_oldest(self) -> str:
        h, (name, _) = self._retained.popitem(last=False)
        self._last_used.pop(h, None)
        return name

    def release_all(self) -> list[str]:
        names = [name for rid in list(self._held) for name in self.release(rid)]
        names += [name for name, _ in self._retained.values()]
        names += [name for orphan in self._orphans.values() for name in orphan.values()]
        self._retained.clear()
        self._orphans.clear()
        self._last_used.clear()
        return names
