"""The scheduler's side of its replica's encoder workers (``--encoder-workers``): which encoder gets each request,
and what each has in hand.

With ``--shared-encoders`` the pool is every encoder of the launch, and each replica's scheduler picks among them by
its own count (it does not see the others' requests): each replica spreads its load, and the encoders' queues
together take what all send.

A request goes to the encoder with the fewest requests outstanding (ties in turn), so a slow image does not hold
back the ones queued behind it while another encoder idles. Every request in hand keeps its pixel segments' names
*busy*: the scheduler unlinks a request's names when it ends, but never a name an encoder may still map
(``SchedulerBase.unlink`` defers those until the answer is back).

An entry an encoder landed in its pool (CUDA or NIXL, ipc/landing.py) is remembered here by name until it is *released*:
where a landing segment would be unlinked, the pool's owner gets ``EncodeRelease`` instead (each name once), and the
rest of the scheduler handles both kinds of landing by name alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.channels import PushSocket
from ipc.encode import EncodeRelease, EncodeRequest
from ipc.inbound import EncoderInbound
from ipc.landing import is_pool_landing
from ipc.steps import EncodeJob


@dataclass
class EncoderPool:
    socks: list[PushSocket[EncoderInbound]]
    load: list[int] = field(default_factory=list)  # requests outstanding per encoder
    in_hand: dict[bytes, tuple[int, list[str]]] = field(default_factory=dict)  # key -> (encoder, pixel names)
    first: int = 0  # the launch-wide index of socks[0] (replica * encoder_workers; 0 with --shared-encoders)
    replica: int = 0  # this scheduler's, named in each request: a shared encoder answers the replica that asked
    pool_landings: dict[str, int] = field(default_factory=dict)  # CUDA landing name -> its encoder (socks' index)
    _next: int = 0

    def __post_init__(self) -> None:
        self.load = [0] * len(self.socks)

    def __bool__(self) -> bool:
        return bool(self.socks)

    def send(self, jobs: list[EncodeJob]) -> None:
        n = len(self.socks)
        for job in jobs:
            j = min(range(n), key=lambda i: (self.load[i], (i - self._next) % n))
            self.socks[j].send(EncodeRequest(job.key, job.items, self.replica))
            self.load[j] += 1
            self._next = (j + 1) % n
            self.in_hand[job.key] = (j, [item.pixels.name for item in job.items if item.pixels is not None])

    def answered(self, key: bytes) -> None:
        """An encoder answered ``key`` (done or failed): its pixels are free to go."""
        entry = self.in_hand.pop(key, None)
        if entry is not None:
            self.load[entry[0]] -= 1

    def busy_names(self) -> set[str]:
        return {name for _, names in self.in_hand.values() for name in names}

    def landed_in_pool(self, name: str, encoder: int) -> None:
        """Encoder ``encoder`` (launch-wide index) landed an entry in its pool (CUDA or NIXL) as ``name``."""
        self.pool_landings[name] = encoder - self.first

    def release(self, names: list[str]) -> list[str]:
        """Send ``EncodeRelease`` for the pool landings among ``names`` (one message per encoder); the other names,
        shared-memory segments to unlink. A pool name already released is dropped: never a second release."""
        segments: list[str] = []
        out: dict[int, list[str]] = {}
        for name in names:
            j = self.pool_landings.pop(name, None)
            if j is not None:
                out.setdefault(j, []).append(name)
            elif not is_pool_landing(name):
                segments.append(name)
        for j, gone in out.items():
            self.socks[j].send(EncodeRelease(gone))
        return segments
