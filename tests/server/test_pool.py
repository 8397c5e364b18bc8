"""The data-parallel router and the replicas' merged stats, without processes: what the router picks for
chats that resend their prefix and images, for unrelated requests, and under load; how replicas' reports
add up."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ipc.requests import RouteRequest
from ipc.stats import SchedulerStats, WorkerStats
from server.pool_stats import merge
from server.router import AFFINITY_MIN_BLOCKS, Router
from workers.engine.core.kv_cache import block_hashes

BS = 16
SYSTEM = list(range(1000, 1000 + BS))  # one block every prompt starts with


def route(rid: str, tokens: list[int], images: Sequence[tuple[bytes, int, int]] = ()) -> RouteRequest:
    return RouteRequest(rid, len(tokens), block_hashes(tokens, BS), list(images), msgspec.Raw(b"\xc0"))


def chat_turn(turn: int) -> list[int]:
    """Turn n's prompt: the system block, then every earlier turn's tokens, then a new question."""
    return SYSTEM + [t for k in range(turn + 1) for t in range(k * 100, k * 100 + 80)]


def test_a_chat_stays_on_its_replica_while_unrelated_requests_alternate() -> None:
    router = Router(2, BS, max_num_seqs=64)
    first = router.route(route("c0", chat_turn(0)))
    router.done(first)
    unrelated = []
    for i in range(6):  # one at a time, as a light load arrives
        unrelated.append(router.route(route(f"u{i}", SYSTEM + list(range(5000 + 100 * i, 5000 + 100 * i + 90)))))
        router.done(unrelated[-1])
    # A shared system block alone is no reason to pile onto one replica: load (a rotation when idle) decides.
    assert unrelated.count(0) == unrelated.count(1) == 3
    for turn in range(1, 5):
        replica, by_affinity = router.pick(route(f"c{turn}", chat_turn(turn)))
        assert (replica, by_affinity) == (first, True)
        router.route(route(f"c{turn}", chat_turn(turn)))
        router.done(replica)


def test_images_held_count_like_prefix_blocks() -> None:
    router = Router(2, BS, max_num_seqs=64)
    image = (b"\x07" * 16, 20, 300)
    r = router.route(route("a", SYSTEM + list(range(400)), [image]))
    router.done(r)
    # Another prompt (different text first, so no prefix in common) showing the same image.
    replica, by_affinity = router.pick(route("b", list(range(9000, 9100)) + list(range(300)), [(image[0], 100, 300)]))
    assert (replica, by_affinity) == (r, True)


def test_an_overloaded_replica_loses_its_affinity() -> None:
    router = Router(2, BS, max_num_seqs=8)  # imbalance limit: 2
    home = router.route(route("c0", chat_turn(0)))
    assert router.pick(route("c1", chat_turn(1))) == (home, True)
    router.views[home].outstanding += 3
    assert router.pick(route("c1", chat_turn(1))) == (1 - home, False)


def test_a_small_gain_is_not_affinity() -> None:
    router = Router(2, BS, max_num_seqs=64)
    shared = SYSTEM + list(range(2000, 2000 + BS * (AFFINITY_MIN_BLOCKS - 2)))  # one block short of the minimum
    home = router.route(route("a", shared))
    router.done(home)
    assert {router.pick(route("b", shared + [1]))[1] for _ in range(2)} == {False}


def test_keys_are_forgotten_past_the_replica_kv_cache_size() -> None:
    router = Router(2, BS, max_num_seqs=64)
    router.set_capacity(0, 8)
    router.set_capacity(1, 8)
    home = router.route(route("a", chat_turn(2)))  # 16 full blocks: only the last 8 are remembered
    assert len(router.views[home].blocks) == 8
    router.done(home)
    # The prefix starts with a forgotten block: no match, no affinity.
    assert router.pick(route("b", chat_turn(3)))[1] is False


def test_a_replica_host_tier_counts_as_held_blocks() -> None:
    """8 GPU blocks and 8 host slots: a 16-block chat is remembered whole, and its next turn goes back for it."""
    router = Router(2, BS, max_num_seqs=64)
    router.set_capacity(0, 8, host_slots=8)
    router.set_capacity(1, 8, host_slots=8)
    home = router.route(route("a", chat_turn(2)))
    assert len(router.views[home].blocks) == 16
    router.done(home)
    assert router.pick(route("b", chat_turn(3))) == (home, True)


def stats(replica: int, **kw: int) -> SchedulerStats:
    base = {f: 0 for f in SchedulerStats.__struct_fields__ if f not in ("workers", "encoders", "replica")}
    base.update(kw)
    return SchedulerStats(**base, replica=replica, workers=[WorkerStats(0, 1, 2, 3, 4)])


def test_replica_reports_add_up() -> None:
    a = stats(0, requests_running=2, kv_blocks_used=10, kv_blocks_total=100, images_encoded=3, plan_bytes_max=500)
    b = stats(1, requests_running=1, kv_blocks_used=30, kv_blocks_total=100, images_encoded=4, plan_bytes_max=900)
    total = merge([b, a], tp_size=1)
    assert (total.requests_running, total.kv_blocks_used, total.kv_blocks_total) == (3, 40, 200)
    assert total.images_encoded == 7 and total.plan_bytes_max == 900  # a size: the largest, not a sum
    assert [w.rank for w in total.workers] == [0, 1]  # launch-wide: replica * tp + rank
    assert merge([a]) is a


def test_round_robin_ignores_what_replicas_hold() -> None:
    router = Router(2, BS, max_num_seqs=64, affinity=False)  # --dp-routing round-robin, the baseline
    picks = [router.route(route(f"c{turn}", chat_turn(turn))) for turn in range(4)]
    assert picks in ([0, 1, 0, 1], [1, 0, 1, 0])
