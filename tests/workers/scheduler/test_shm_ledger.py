from __future__ import annotations

from workers.scheduler.shm_ledger import ShmLedger

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def test_bytes_count_each_image_once_across_requests() -> None:
    ledger = ShmLedger(budget_bytes=1000)
    ledger.hold("r1", ["a1", "b1"], {A: 100, B: 200}, {A: "a1", B: "b1"})
    ledger.hold("r2", ["a2"], {A: 100}, {A: "a2"})  # a hard link of the same image
    assert ledger.used_bytes == 300 and ledger.segments == 3
    assert ledger.extra_bytes({A: 100, C: 50}) == 50


def test_last_holder_leaves_one_name_retained_for_the_next_turn() -> None:
    ledger = ShmLedger(budget_bytes=1000, retain_fraction=0.5)
    ledger.hold("r1", ["a1", "b1"], {A: 100, B: 200}, {A: "a1", B: "b1"})
    ledger.hold("r2", ["a2"], {A: 100}, {A: "a2"})
    assert ledger.release("r1") == ["a1"]  # A is still held by r2; B is kept alive under b1
    assert ledger.retained_segments == 1 and ledger.used_bytes == 300
    assert ledger.extra_bytes({B: 200}) == 0  # a new turn resending B adds nothing
    assert ledger.release("r2") == []  # A's last name is retained too
    assert ledger.retained_bytes == 300 and ledger.segments == 2


def test_retention_is_bounded_and_gives_way_to_new_requests() -> None:
    ledger = ShmLedger(budget_bytes=1000, retain_fraction=0.5)
    ledger.hold("r1", ["a1", "b1", "c1"], {A: 300, B: 150, C: 100}, {A: "a1", B: "b1", C: "c1"})
    # 550 bytes would stay, over the 500 allowed: the oldest retained image goes.
    assert sorted(ledger.release("r1")) == ["a1"]
    assert ledger.retained_bytes == 250
    # A new request needing 900 bytes pushes retained images out, oldest first, only as far as needed.
    assert ledger.make_room(900) == ["b1"]
    assert ledger.make_room(950) == ["c1"]
    assert ledger.used_bytes == 0


def test_no_retention_unlinks_everything() -> None:
    ledger = ShmLedger(budget_bytes=1000, retain_fraction=0.0)
    ledger.hold("r1", ["a1"], {A: 100}, {A: "a1"})
    assert ledger.release("r1") == ["a1"] and ledger.segments == 0


def test_release_all_returns_live_and_retained_names() -> None:
    ledger = ShmLedger(budget_bytes=1000)
    ledger.hold("r1", ["a1"], {A: 100}, {A: "a1"})
    ledger.release("r1")
    ledger.hold("r2", ["b1"], {B: 100}, {B: "b1"})
    assert sorted(ledger.release_all()) == ["a1", "b1"] and ledger.segments == 0


def test_retained_images_expire_when_idle_and_not_while_held() -> None:
    ledger = ShmLedger(budget_bytes=1000, retain_idle_s=10.0)
    ledger.hold("r1", ["a1", "b1"], {A: 100, B: 100}, {A: "a1", B: "b1"})
    assert ledger.release("r1", now=0.0) == [] and ledger.retained_segments == 2
    ledger.hold("r2", ["a2"], {A: 100}, {A: "a2"})  # A is in use again: it cannot expire meanwhile
    assert ledger.expire(now=9.0) == []
    assert ledger.expire(now=10.5) == ["b1"]
    assert ledger.release("r2", now=11.0) == ["a2"]  # A's retained name stays, idle from now
    assert ledger.expire(now=20.0) == [] and ledger.expire(now=21.5) == ["a1"]
    assert ledger.segments == 0 and ledger.used_bytes == 0
    assert ShmLedger(budget_bytes=1000).expire(now=1e9) == []  # 0: never by age


def test_images_written_after_arrival_join_the_holding_once_published() -> None:
    ledger = ShmLedger(budget_bytes=1000, retain_fraction=1.0)
    ledger.hold("r1", ["a1"], {A: 100, B: 200}, {A: "a1"}, {B: "b1"})  # B still being written: bytes count already
    assert ledger.used_bytes == 300 and ledger.segments == 1
    assert ledger.publish("r1", [B]) == ([B], [])
    assert ledger.publish("gone", [C]) == ([], [])  # nobody's: nothing to record or unlink
    assert ledger.segments == 2
    assert ledger.release("r1") == []  # both retained, B under the name it was published as
    assert ledger.release_all() == ["a1", "b1"]


def test_names_still_being_written_outlive_their_request_until_published() -> None:
    ledger = ShmLedger(budget_bytes=1000, retain_fraction=0.0)
    ledger.hold("r1", ["a1"], {A: 100, B: 200, C: 50}, {A: "a1"}, {B: "b1", C: "c1"})
    assert ledger.publish("r1", [B]) == ([B], [])
    # r1 ends (aborted) while C is still being written: its name goes now, and again once it is published.
    assert sorted(ledger.release("r1")) == ["a1", "b1", "c1"]
    assert ledger.publish("r1", [C]) == ([], ["c1"])
    assert ledger.publish("r1", [C]) == ([], [])
    # Refused on arrival: the same for its pending names; a tokenizer's MediaFailed forgets them (it unlinks them).
    assert ledger.orphan("r2", {A: "a2"}) == ["a2"]
    ledger.hold("r3", [], {B: 200}, {}, {B: "b3"})
    assert ledger.pending_failed("r3") == ["b3"] and ledger.pending_failed("r3") == []
    assert ledger.release_all() == ["a2"]


def test_landing_segments_count_against_the_budget_until_unlinked() -> None:
    """--encoder-workers: an encoder's landing segment counts from its EncodeDone until the scheduler unlinks it;
    it is never refused, but while it is there a new image request that would pass the budget is."""
    ledger = ShmLedger(budget_bytes=1000, retain_fraction=0.5)
    ledger.hold("r1", ["a1"], {A: 300}, {A: "a1"})
    ledger.land("emb-a", 600)  # A's embeddings: larger than its pixels, as they usually are
    assert ledger.used_bytes == 900 and ledger.landing_bytes == 600 and ledger.landing_segments == 1
    assert ledger.segments == 1  # pixel segments only
    extra = ledger.extra_bytes({B: 200})
    assert ledger.make_room(extra) == [] and ledger.used_bytes + extra > ledger.budget_bytes  # B's request: 503
    ledger.land("emb-b", 400)  # past the budget: accepted all the same
    assert ledger.used_bytes == 1300
    ledger.unlinked(["emb-a", "a-other-pixel-name"])  # imported and unlinked (pixel names change nothing)
    assert ledger.landing_bytes == 400 and ledger.used_bytes == 700
    assert ledger.release("r1") == []  # A retained (300): retained images give way to landing bytes too
    assert ledger.make_room(extra) == []  # 700 + 200 fits
    assert ledger.make_room(400) == ["a1"]
    ledger.unlinked(["emb-b"])
    assert ledger.used_bytes == 0 and ledger.landing_segments == 0
