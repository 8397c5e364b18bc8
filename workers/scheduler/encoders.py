"""The scheduler's side of its replica's encoder workers (``--encoder-workers``): which encoder gets each request,
and what each has in hand.

A request goes to the encoder with the fewest requests outstanding (ties in turn), so a slow image does not hold
back the ones queued behind it while another encoder idles. Every request in hand keeps its pixel segments' names
*busy*: the scheduler unlinks a request's names when it ends, but never a name an encoder may still map
(``SchedulerBase.unlink`` defers those until the answer is back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.channels import PushSocket
from ipc.encode import EncodeRequest
from ipc.inbound import EncoderInbound
from ipc.steps import EncodeJob


@dataclass
class EncoderPool:
    socks: list[PushSocket[EncoderInbound]]
    load: list[int] = field(default_factory=list)  # requests outstanding per encoder
    in_hand: dict[bytes, tuple[int, list[str]]] = field(default_factory=dict)  # key -> (encoder, pixel names)
    _next: int = 0

    def __post_init__(self) -> None:
        self.load = [0] * len(self.socks)

    def __bool__(self) -> bool:
        return bool(self.socks)

    def send(self, jobs: list[EncodeJob]) -> None:
        n = len(self.socks)
        for job in jobs:
            j = min(range(n), key=lambda i: (self.load[i], (i - self._next) % n))
            self.socks[j].send(EncodeRequest(job.key, job.items))
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
