"""The frontend's data-parallel router (``--dp`` > 1): which replica a prepared request goes to.

A replica is worth choosing when it already holds what the request needs: the KV blocks of its prompt's
prefix (a chat's earlier turns) and the embeddings of its images. Both are keyed by content, with the
keys the scheduler itself uses: the tokenizer sends the prompt's chained prefix-block keys
(``kv_cache.block_hashes``, the first ``ROUTE_MAX_BLOCKS``) and its images' content hashes in a
``RouteRequest``.

What each replica holds is *remembered here* rather than reported by the schedulers: a bounded LRU per
replica of the keys routed to it, sized like that replica's KV cache (its GPU blocks plus its host tier's slots,
``--kv-host-cache-mb``). Why not the schedulers' own word:
the router must decide the moment a request is ready, and a chat's next turn often arrives before its last
turn's blocks are even computed, let alone reported; every routing decision is already here, in order,
with no message to wait for. The price is an approximation of eviction (an LRU of keys routed, not of
blocks kept), which costs at worst one re-encode and one re-prefill on the chosen replica, what any
other replica would have cost anyway: affinity is a hint, never correctness. (External routers that want
the exact state subscribe to the KV-cache events, ipc/kv_events.py.)

Scoring: the tokens a replica would not recompute = its matched prefix blocks x block size + the tokens
of images past that prefix whose embeddings it holds. A replica is chosen for affinity when it saves
markedly more than the worst one (``AFFINITY_MIN_BLOCKS`` blocks and a quarter of the prompt: a short
system prompt every request shares must not pull all traffic to the first replica that saw it) and is not
overloaded (a quarter of ``max_num_seqs`` more requests outstanding than the least busy one: past that,
waiting costs more than recomputing); otherwise the least busy replica (fewest outstanding requests, ties
rotating) takes it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ipc.requests import RouteRequest

AFFINITY_MIN_SHARE = 0.25  # of the prompt's tokens a replica must save over the worst one to win by affinity
AFFINITY_MIN_BLOCKS = 4  # and at least this many blocks' worth of tokens
IMAGE_KEYS = 4096  # image hashes remembered per replica (an embedding cache rarely holds more)
DEFAULT_BLOCK_KEYS = 65536  # per replica until its scheduler reports its KV cache size


@dataclass
class ReplicaView:
    """What the router believes one replica holds, and its load."""

    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    images: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    block_capacity: int = DEFAULT_BLOCK_KEYS
    outstanding: int = 0  # requests routed here and not finished
    routed: int = 0
    by_affinity: int = 0  # of them, sent here for what it held rather than for load

    def saved(self, route: RouteRequest, block_size: int) -> int:
        """Prompt tokens this replica would not recompute (prefix blocks) or re-encode (images)."""
        matched = 0
        for key in route.blocks:
            if key not in self.blocks:
                break
            matched += 1
        covered = matched * block_size
        return covered + sum(n for h, first, n in route.images if first + n > covered and h in self.images)

    def remember(self, route: RouteRequest) -> None:
        for keys, new, capacity in ((self.blocks, route.blocks, self.block_capacity),
                                    (self.images, [h for h, _, _ in route.images], IMAGE_KEYS)):
            for key in new:
                keys[key] = None
                keys.move_to_end(key)
            while len(keys) > capacity:
                keys.popitem(last=False)


class Router:
    def __init__(self, replicas: int, block_size: int, max_num_seqs: int, affinity: bool = True) -> None:
        self.views = [ReplicaView() for _ in range(replicas)]
        self.block_size = block_size
        self.affinity = affinity  # False (--dp-routing round-robin): replicas in turn, the baseline
        self.max_imbalance = max(1, max_num_seqs // 4)  # outstanding requests past the least busy replica's
        self._turn = 0

    def set_capacity(self, replica: int, kv_blocks: int, host_slots: int = 0) -> None:
        """The replica's KV cache size in blocks and its host tier's slots (from its stats): how many prefix keys it
        can hold (a prefix block on the host is loaded back, not recomputed, so it counts as held)."""
        if kv_blocks > 0 and 0 <= replica < len(self.views):
            self.views[replica].block_capacity = kv_blocks + max(0, host_slots)

    def least_busy(self) -> int:
        n = len(self.views)
        self._turn = start = (self._turn + 1) % n
        return min(range(n), key=lambda r: (self.views[r].outstanding, (r - start) % n))

    def pick(self, route: RouteRequest) -> tuple[int, bool]:
        """The replica for ``route`` and whether affinity (not load) chose it; records nothing."""
        if len(self.views) == 1:
            return 0, False
        if not self.affinity:
            self._turn = (self._turn + 1) % len(self.views)
            return self._turn, False
        saved = [view.saved(route, self.block_size) for view in self.views]
        idle = min(view.outstanding for view in self.views)
        best = max(range(len(saved)), key=lambda r: (saved[r], -self.views[r].outstanding))
        gain = saved[best] - min(saved)
        if (
            gain >= max(AFFINITY_MIN_BLOCKS * self.block_size, AFFINITY_MIN_SHARE * route.prompt_tokens)
            and self.views[best].outstanding - idle <= self.max_imbalance
        ):
            return best, True
        return self.least_busy(), False

    def route(self, route: RouteRequest) -> int:
        """Choose a replica for a request that will run there, and count it against that replica."""
        replica, affinity = self.pick(route)
        view = self.views[replica]
        view.remember(route)
        view.outstanding += 1
        view.routed += 1
        view.by_affinity += affinity
        return replica

    def done(self, replica: int) -> None:
        """A request routed to ``replica`` has finished (answered, failed or abandoned)."""
        if 0 <= replica < len(self.views):
            self.views[replica].outstanding -= 1
