"""Client media ids (a content part's ``uuid``, vLLM's ``multi_modal_uuids``): which media a uuid names, for every
tokenizer process and ``--dp`` replica of a launch.

A part sent with data and a ``uuid`` records the uuid -> media mapping as a small file in /dev/shm named under the
launch's prefix by a hash of the uuid (``glimpse-{launch}-uuid-{hash}``), written to a temporary name and renamed
into place, so a reader sees a whole record or none. The launch's sweep (ipc/shm.py ``sweep``, at start, on exit,
after a crash) removes the records with the pixel segments; a running server drops records unused for
``--shm-retain-idle-s`` (by then their pixels are gone too) and the oldest past `MAX_RECORDS`.

A record holds the media's digest before any request setting frames it (so a later request may name it under its own
settings) and, for a video, its probe (frame timestamps, size: what planning it takes, so any tokenizer lays it out
without the bytes). It never holds pixels: a part named without data is served from the live segments of its media
(image_prep.py, video_prep.py), and is a 400 naming the uuid where they are gone.

The content hash stays the media's identity everywhere (segments, embedding and prefix caches): a uuid only finds
the bytes' hash. So a uuid resent with other data maps to the new data from then on (last writer wins), and a client
can never make one image's cache entries answer for another's, unlike vLLM, which keys its caches by the uuid itself.
"""

from __future__ import annotations

import os
import time

import blake3
import msgspec

from ipc import shm
from workers.common.errors import BadRequest
from workers.engine.prompt.video_decode import VideoProbe

MAX_RECORDS = 1 << 16  # per launch: past it the least recently used go (a record is one small tmpfs file)
_PRUNE_EVERY = 256  # records written by this tokenizer between two prunes
_KEY = "uuid-"


class MediaRecord(msgspec.Struct, frozen=True):
    kind: str  # "image" or "video"
    digest: bytes  # image: MMProcessor.media_hash of the bytes; video: video_prompt.content_digest
    probe: VideoProbe | None = None  # a video's layout from its packets


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(MediaRecord)


def unknown_uuid(uuid: str, param: str) -> BadRequest:
    """The answer to a part that names media by ``uuid`` alone that this server does not have (never sent, or its
    pixels gone since): the client resends the data."""
    return BadRequest(
        f"The media with uuid {uuid!r} is not cached on this server (never sent, or evicted since); "
        "send the part with its data.",
        param=param,
        code="media_not_cached",
    )


class UuidRegistry:
    """One tokenizer's view of the launch's uuid records."""

    def __init__(self, launch_id: str, idle_s: float, nonce: str) -> None:
        self.launch_id, self.idle_s, self.nonce = launch_id, idle_s, nonce
        self.written = 0

    def name(self, uuid: str) -> str:
        return shm.segment_name(self.launch_id, _KEY + blake3.blake3(uuid.encode("utf-8", "surrogatepass")).hexdigest(16))

    def _path(self, name: str) -> str:
        return os.path.join(shm.SHM_DIR, name)

    def put(self, uuid: str, record: MediaRecord) -> None:
        """Map ``uuid`` to ``record`` for every tokenizer of the launch (replacing what it mapped to)."""
        final = self._path(self.name(uuid))
        self.written += 1
        tmp = self._path(shm.segment_name(self.launch_id, f"tmp-{self.nonce}u{self.written:x}"))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # private, as the pixel segments are
            with os.fdopen(fd, "wb") as f:
                f.write(_encoder.encode(record))
            os.replace(tmp, final)  # atomic: a reader sees the old record or the new one
        except OSError:
            # A full /dev/shm: the uuid is not remembered; the request itself is served.
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            return
        if self.written % _PRUNE_EVERY == 0:
            self.prune()

    def get(self, uuid: str) -> MediaRecord | None:
        path = self._path(self.name(uuid))
        try:
            with open(path, "rb") as f:
                record = _decoder.decode(f.read())
            os.utime(path)  # used: kept by prune like a retained segment that is reused
        except (FileNotFoundError, msgspec.DecodeError):
            return None
        return record

    def prune(self, now: float | None = None) -> int:
        """Unlink the records unused for ``idle_s`` (0: no age limit), and the least recently used past
        `MAX_RECORDS`; returns how many went."""
        now = time.time() if now is None else now
        aged: list[tuple[float, str]] = []
        for name in shm.find_segments(self.launch_id, _KEY):
            try:
                aged.append((os.stat(self._path(name)).st_mtime, name))
            except FileNotFoundError:
                continue
        aged.sort()
        excess = max(0, len(aged) - MAX_RECORDS)
        gone = [name for i, (mtime, name) in enumerate(aged) if i < excess or (self.idle_s and now - mtime > self.idle_s)]
        for name in gone:
            shm.ShmSegment.unlink(name)
        return len(gone)
